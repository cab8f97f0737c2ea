"""Schedules, communication and executors (installed as `pdcompile.runtime`).

The executors run what the schedules of `pdcompile.scheduling` build, checked before they run
(`validate`); the simulator runs the same actions on modelled time. Imports are lazy.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "validate_schedule": "pdcompile.passes.planning.validate",
    "load_full_state_dict": "pdcompile.runtime.checkpoint",
    "Simulation": "pdcompile.passes.planning.simulator",
    "simulate": "pdcompile.passes.planning.simulator",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pdcompile.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
