"""The phases' folders and the directions their imports point: capture and passes never import
the runtime or the CLI, the runtime never imports the CLI or capture, nothing imports the CLI,
and the schedules, the planner's searches and the re-planning decision are torch-free. Read
from the source (every import, inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the installed package it is
PACKAGES = {ROOT / "pdcompile": "pdcompile", ROOT / "passes": "pdcompile.passes",
            ROOT / "runtime": "pdcompile.runtime"}  # fmt: skip


def modules() -> dict[str, set[str]]:
    """Installed module name -> every module it imports."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            imported = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            found[name] = imported
    return found


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


RULES = [  # (importers, what they must not import)
    ("pdcompile.capture", ("pdcompile.runtime", "pdcompile.cli")),
    ("pdcompile.passes", ("pdcompile.runtime", "pdcompile.cli")),
    ("pdcompile.runtime", ("pdcompile.cli", "pdcompile.capture")),
    ("pdcompile.schedules", ("torch", "pdcompile.runtime", "pdcompile.cli")),
    ("pdcompile.search", ("torch", "pdcompile.runtime", "pdcompile.cli")),
    ("pdcompile.closed_loop.decision", ("torch", "pdcompile.runtime", "pdcompile.cli")),
    ("pdcompile", ("pdcompile.cli",)),  # nothing outside the CLI imports it
]


@pytest.mark.parametrize(("importers", "forbidden"), RULES)
def test_imports_point_down(importers: str, forbidden: tuple[str, ...]) -> None:
    wrong = [
        f"{name} imports {target}"
        for name, imported in modules().items()
        if within(name, importers) and not within(name, "pdcompile.cli")
        for target in sorted(imported)
        if any(within(target, f) for f in forbidden)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_phases_have_their_folders() -> None:
    found = modules()
    for module in ("pdcompile.capture.tracing", "pdcompile.codegen.stage_codegen",
                   "pdcompile.cli.handlers", "pdcompile.cli.parser", "pdcompile.pictures.gantt",
                   "pdcompile.schedules.one_f_one_b", "pdcompile.schedules.pipedream"):  # fmt: skip
        assert module in found, module
    flat = [p.name for p in (ROOT / "pdcompile").glob("*.py")]
    # 25 since issue 30-31 added progress, plan_words and regular_file; issue 33 brings it to ~10
    assert len(flat) <= 25, f"pdcompile/ holds {len(flat)} files again: {sorted(flat)}"


def test_the_rule_catches_a_wrong_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: a pass importing the runtime is reported."""
    bad = tmp_path / "passes"
    bad.mkdir()
    (bad / "leaky.py").write_text("def f():\n    from pdcompile.runtime.simulator import run\n")
    monkeypatch.setitem(PACKAGES, bad, "pdcompile.passes")
    with pytest.raises(AssertionError, match="pdcompile.passes.leaky imports pdcompile.runtime"):
        test_imports_point_down("pdcompile.passes", ("pdcompile.runtime",))
