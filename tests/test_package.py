"""Packaging: the installed layout, the public names, and README/CI agreeing on the test command."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pdcompile

ROOT = Path(__file__).resolve().parents[1]


def test_passes_and_runtime_live_inside_pdcompile_only(tmp_path: Path) -> None:
    probe = (
        "import importlib.util, pdcompile.passes, pdcompile.runtime;"
        "print(importlib.util.find_spec('passes'), importlib.util.find_spec('runtime'),"
        " pdcompile.passes.__file__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    top_passes, top_runtime, passes_file = done.stdout.split()
    assert (top_passes, top_runtime) == ("None", "None")
    assert Path(passes_file).parent.name == "passes"


def test_wheel_maps_passes_and_runtime_under_pdcompile(tmp_path: Path) -> None:
    source = tmp_path / "src"  # a copy, so the build leaves no build/ folder in the checkout
    ignore = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT, source, ignore=ignore)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("pdcompile-*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    assert "pdcompile/passes/__init__.py" in files and "pdcompile/runtime/__init__.py" in files
    assert "pdcompile/graph/shapes.py" in files and "pdcompile/capture/tracing.py" in files
    assert "pdcompile/passes/planning/solvers/dp.py" in files
    tops = {f.split("/")[0] for f in files if not f.split("/")[0].endswith(".dist-info")}
    assert tops == {"pdcompile"}
    entry_points = next(f for f in files if f.endswith("entry_points.txt"))
    assert "pdcompile = pdcompile.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_public_names() -> None:
    for name in pdcompile.__all__:
        assert hasattr(pdcompile, name), name
    errors = "Trace Cost Partition Codegen Schedule StageComm Checkpoint PipelineTimeout Spec"
    for error in (f"{e}Error" for e in errors.split()):
        assert issubclass(getattr(pdcompile, error), pdcompile.PdcompileError)


def _fenced_commands(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = [b.strip() for b in _fenced_commands(readme) if "pytest" in b]
    assert len(blocks) == 1, "README must show exactly one test command"
    ci = (ROOT / ".ci" / "run").read_text()
    assert blocks[0] in ci
    assert "torch==2.13.0" in blocks[0] and ".[test,hf,plot]" in blocks[0]


def test_readme_example_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    exec(compile(example, "README.md", "exec"), {})


def test_code_is_ruff_clean() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_lazy_name_resolves() -> None:
    import pdcompile.passes

    for name in pdcompile.passes.__all__:
        assert callable(getattr(pdcompile.passes, name)), name
