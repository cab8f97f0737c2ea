"""The schedule registry: `register_schedule(name)` and `schedules()`, like the solvers'.

The built-in schedules are found by listing this package: a new file in it that registers a
schedule needs no line here."""

from __future__ import annotations

from collections.abc import Callable

from pdcompile.core.errors import ScheduleError
from pdcompile.core.registry import Registry
from pdcompile.scheduling.base import PipelineSchedule

SCHEDULES: Registry[PipelineSchedule] = Registry(
    "schedule",
    (  # the simplest first: the order schedule="auto" breaks ties in (the others follow)
        "pdcompile.scheduling.one_f_one_b",
        "pdcompile.scheduling.gpipe",
        "pdcompile.scheduling.pipedream",
        "pdcompile.scheduling.two_bw",
        "pdcompile.scheduling.interleaved_1f1b",
        "pdcompile.scheduling.zb_h1",
        "pdcompile.scheduling.zb_h2",
        "pdcompile.scheduling.zb_v",
    ),
    ScheduleError,
    package="pdcompile.scheduling",
)


def register_schedule(name: str) -> Callable[[type[PipelineSchedule]], type[PipelineSchedule]]:
    """Register a `PipelineSchedule` subclass under `name` (its docstring's first line is its
    description in `schedules()`); a name registered again is replaced.

    Example:
        >>> @pdcompile.register_schedule("1f1b-deep")
        ... class DeepWarmup(WarmupSchedule):
        ...     '''1F1B with one more warm-up forward per stage.'''
        ...     def warmup(self, replicas, stage, num_microbatches):
        ...         return super().warmup(replicas, stage, num_microbatches) + 1
    """

    def decorate(cls: type[PipelineSchedule]) -> type[PipelineSchedule]:
        if not (isinstance(cls, type) and issubclass(cls, PipelineSchedule)):
            raise ScheduleError(
                f"register_schedule({name!r}) decorates a PipelineSchedule subclass, got {cls!r}"
            )
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise ScheduleError(
                f"schedule {name!r} ({cls.__name__}) does not define {', '.join(missing)}, the "
                "required core: every rank's order of compute items (see docs/schedules.md); "
                "for 1F1B's order with a warm-up of your own, subclass "
                "pdcompile.scheduling.WarmupSchedule"
            )
        instance = cls()
        instance.name = name
        SCHEDULES.add(name, instance)
        return cls

    return decorate


def schedules() -> dict[str, str]:
    """Registered schedule names -> one-line descriptions."""
    return SCHEDULES.describe()


def get_schedule(schedule: str | PipelineSchedule) -> PipelineSchedule:
    """The registered schedule called `schedule` (a schedule object is returned as it is).

    Raises:
        ScheduleError: no schedule has that name (the message lists them).
    """
    if isinstance(schedule, PipelineSchedule):
        return schedule
    return SCHEDULES.get(schedule)
