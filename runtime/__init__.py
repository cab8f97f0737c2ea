"""Schedules, communication and executors (installed as `pdcompile.runtime`).

The executors run what the schedules of `pdcompile.schedules` build, checked before they run
(`validate`); the simulator runs the same actions on modelled time. Imports are lazy.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "validate_schedule": "pdcompile.runtime.validate",
    "load_full_state_dict": "pdcompile.runtime.checkpoint",
    "Simulation": "pdcompile.runtime.simulator",
    "simulate": "pdcompile.runtime.simulator",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pdcompile.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
