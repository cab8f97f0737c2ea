"""Long test tiers: a module marked with a tier runs only when the run asks for it (`-m NAME`
or `PDCOMPILE_<NAME>=1`); `.ci/run` runs every tier after the README's command."""

from __future__ import annotations

import os

import pytest


def only_in_tier(request: pytest.FixtureRequest, name: str, what: str) -> None:
    """Skip the test unless the run selected tier `name` (`what` says why it is a tier)."""
    marks = request.config.option.markexpr or ""
    if name not in marks and os.environ.get(f"PDCOMPILE_{name.upper()}") != "1":
        pytest.skip(f"the {name} tier ({what}): run it with -m {name} (.ci/run does)")
