"""The schedules a test runs, read from the registry (never listed by hand)."""

from __future__ import annotations

from collections.abc import Callable

from pdcompile.scheduling import PipelineSchedule, get_schedule
from pdcompile.scheduling.registry import SCHEDULES


def builtin_kinds(where: Callable[[PipelineSchedule], bool] | None = None) -> list[str]:
    """The package's own schedules (registered by its modules, not by test files) that
    `where(rules)` accepts, in the registry's order (the simplest first)."""
    order = SCHEDULES.builtins
    kinds = [name for name in SCHEDULES if type(get_schedule(name)).__module__ in order]
    kinds.sort(key=lambda name: (order.index(type(get_schedule(name)).__module__), name))
    return [name for name in kinds if where is None or where(get_schedule(name))]
