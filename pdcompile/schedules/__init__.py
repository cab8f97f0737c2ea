"""Schedules: one object per kind, registered by name, that planner, simulator and runtime all
derive from. Torch-free.

`base.PipelineSchedule` holds a kind's rules (order, warm-up, accepted microbatch counts, weight
versions, clipping, closed forms); one file per built-in kind (`gpipe`, `one_f_one_b`, `pipedream`,
`two_bw`, `interleaved_1f1b`, `zb_h1`, `zb_h2`, `zb_v`; `chunks` holds the orders the last four
share) registers a subclass; `builder` turns any of them and a plan's layout into every rank's
`actions`, from which everything else is derived (the simulator reads activations and weight
versions in flight, step time and bubble off them). The package is callable as the public
`pdcompile.schedules()`."""

from __future__ import annotations

from pdcompile.callable_package import make_callable
from pdcompile.schedules.actions import Action, Schedule
from pdcompile.schedules.base import PipelineSchedule
from pdcompile.schedules.builder import (
    build_schedule,
    check_nonfinite,
    forward_schedule,
    replica_orders,
)
from pdcompile.schedules.registry import get_schedule, register_schedule, schedules

make_callable(__name__, "pdcompile.schedules.registry:schedules")  # `pdcompile.schedules()`

__all__ = [
    "Action",
    "PipelineSchedule",
    "Schedule",
    "build_schedule",
    "check_nonfinite",
    "forward_schedule",
    "get_schedule",
    "replica_orders",
    "register_schedule",
    "schedules",
]
