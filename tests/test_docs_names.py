"""Every name of the package the documents give resolves: each `from pdcompile... import name`
line of a code block and each dotted name `pdcompile.a.b...` in backticks (two-part names such
as `pdcompile.param_bytes` are node-meta keys and format names, not checked). A renamed or
moved module otherwise leaves examples that raise ImportError for the reader who copies them."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("examples/**/*.md")])
IMPORTED = re.compile(r"^\s*from (pdcompile[\w.]*) import \(?([\w, ]+)\)?$", re.M)
DOTTED = re.compile(r"`(pdcompile(?:\.\w+){2,})(?:\(|`)")


def _resolves(dotted: str) -> bool:
    """Whether `dotted` names a module, or an attribute reached from the longest module in it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


def _names(text: str) -> list[str]:
    imported = [
        f"{m[1]}.{name}" for m in IMPORTED.finditer(text) for name in re.findall(r"\w+", m[2])
    ]
    return imported + DOTTED.findall(text)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_package_name_a_document_gives_resolves(document: Path) -> None:
    unresolved = [name for name in _names(document.read_text()) if not _resolves(name)]
    assert not unresolved, f"{document.name} names what the package lacks: {unresolved}"


def test_the_check_finds_a_name_that_moved() -> None:
    text = "```python\nfrom pdcompile.passes.planning.planner import make_plan\n```\n"
    assert _names(text) == ["pdcompile.passes.planning.planner.make_plan"]
    assert not _resolves(_names(text)[0])
    assert _resolves("pdcompile.passes.planning.solver_kit.make_plan")
