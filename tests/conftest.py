"""Long test tiers: a test marked with a tier runs only when the run asks for it (`-m NAME`, or
`PDCOMPILE_<NAME>=1` in any run); `.ci/run` runs every tier after the README's command."""

from __future__ import annotations

import os

import pytest

# tier -> what makes it long
TIERS = {
    "multihost": "torchrun launches across network namespaces",
    "schedules": "every schedule trained on 2 and 4 spawned ranks",
    "faults": "ranks stopped, killed or hanging, waited out to their timeouts",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip each tier's tests unless the run selected that tier."""
    marks = config.option.markexpr or ""
    for name, what in TIERS.items():
        if name in marks or os.environ.get(f"PDCOMPILE_{name.upper()}") == "1":
            continue
        skip = pytest.mark.skip(reason=f"the {name} tier ({what}): run it with -m {name}")
        for item in items:
            if item.get_closest_marker(name):
                item.add_marker(skip)
