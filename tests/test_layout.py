"""The floor plan: the package's folders in processing order, and one rule read from the source
(every import, inside functions too): a folder imports only folders listed before it. The list
is docs/architecture.md's ("Folders in processing order"), so the document and the code agree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the installed package it is
PACKAGES = {ROOT / "pdcompile": "pdcompile", ROOT / "passes": "pdcompile.passes",
            ROOT / "runtime": "pdcompile.runtime"}  # fmt: skip
DOC = ROOT / "docs" / "architecture.md"
TORCH_FREE = ("pdcompile.scheduling", "pdcompile.passes.planning")  # importable without torch


def folders() -> list[str]:
    """The folders as docs/architecture.md lists them, first to last (installed names)."""
    text = DOC.read_text().split("## Folders in processing order", 1)[1].split("\n## ", 1)[0]
    paths = re.findall(r"^\d+\. `([\w/]+)/`", text, flags=re.M)
    top = {"pdcompile": "pdcompile", "passes": "pdcompile.passes", "runtime": "pdcompile.runtime"}
    return [".".join((top[p.split("/")[0]], *p.split("/")[1:])) for p in paths]


def modules() -> dict[str, tuple[str, set[str]]]:
    """Installed module name -> (its folder, every pdcompile module it imports)."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            home = name if path.name == "__init__.py" else name.rpartition(".")[0]
            imported = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            found[name] = (home, imported)
    return found


def folder_of(name: str, known: dict[str, tuple[str, set[str]]]) -> str | None:
    """The folder of module `name` (or of the module a name imported from it belongs to)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return known[name][0] if name else None


def test_a_folder_imports_only_folders_listed_before_it() -> None:
    order, found = folders(), modules()
    unlisted = sorted({home for home, _ in found.values()} - set(order))
    assert not unlisted, f"folders docs/architecture.md does not list: {unlisted}"
    wrong = [
        f"{name} ({home}) imports {target} ({there})"
        for name, (home, imported) in found.items()
        for target in sorted(imported)
        if target.startswith("pdcompile")
        and (there := folder_of(target, found)) is not None
        and order.index(there) > order.index(home)
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", TORCH_FREE)
def test_the_schedules_and_the_planner_are_torch_free(package: str) -> None:
    found = modules()
    wrong = [f"{name} imports {t}" for name, (_, imported) in found.items()
             if name.startswith(package)
             for t in imported if t == "torch" or t.startswith("torch.")]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_few_modules_lie_flat_in_pdcompile() -> None:
    flat = sorted(p.name for p in (ROOT / "pdcompile").glob("*.py"))
    assert len(flat) <= 10, f"pdcompile/ holds {len(flat)} files: {flat}"


def test_the_rule_catches_a_wrong_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: a core module importing the runtime is reported."""
    bad = tmp_path / "pdcompile"
    (bad / "core").mkdir(parents=True)
    leaky = "def f():\n    from pdcompile.runtime.wire import pack\n"
    (bad / "core" / "leaky.py").write_text(leaky)
    monkeypatch.setitem(PACKAGES, bad, "pdcompile")
    with pytest.raises(AssertionError, match="pdcompile.core.leaky .pdcompile.core. imports"):
        test_a_folder_imports_only_folders_listed_before_it()
