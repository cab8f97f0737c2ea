"""Schedules, communication and executors (installed as `pdcompile.runtime`).

Schedules are data (`actions`, `schedules`), checked before they run (`validate`); weight
versions are pure functions (`versions`). These parts are torch-free and import lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Action": "pdcompile.runtime.actions",
    "Schedule": "pdcompile.runtime.actions",
    "build_schedule": "pdcompile.runtime.schedules",
    "validate_schedule": "pdcompile.runtime.validate",
    "version": "pdcompile.runtime.versions",
    "vertical_version": "pdcompile.runtime.versions",
    "warmup": "pdcompile.runtime.versions",
    "load_full_state_dict": "pdcompile.runtime.checkpoint",
    "Simulation": "pdcompile.runtime.simulator",
    "simulate": "pdcompile.runtime.simulator",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pdcompile.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
