"""Schedules: one object per kind, registered by name, that planner, simulator and runtime all
derive from. Torch-free.

`base.PipelineSchedule` is the contract: a required core (what it accepts, every rank's order
of compute items, where its stages sit), an optional weight policy (`weight_policy`) and
optional closed forms (`closed_forms`; without them the memory counts are walked off the orders:
`memory_walk`). `warmup_orders.WarmupSchedule` is the 1F1B family's per-replica orders; one
file per built-in kind (`gpipe`, `one_f_one_b`, `pipedream`, `two_bw`, `interleaved_1f1b`,
`zb_h1`, `zb_h2`, `zb_v`; `chunks` holds the orders the last four share) registers a subclass,
found by listing this package; `action_kinds` is the one table of action kinds; `builder` turns
any schedule and a plan's layout (`placement`) into every rank's `actions`, from which
everything else is derived (the simulator reads activations and weight versions in flight, step
time and bubble off them). The public `pdcompile.schedules()` is `registry.schedules`."""

from __future__ import annotations

from pdcompile.scheduling.actions import Action, Schedule
from pdcompile.scheduling.base import PipelineSchedule
from pdcompile.scheduling.builder import (
    build_schedule,
    check_nonfinite,
    forward_schedule,
    replica_orders,
)
from pdcompile.scheduling.closed_forms import ClosedForms
from pdcompile.scheduling.placement import Placement
from pdcompile.scheduling.registry import get_schedule, register_schedule, schedules
from pdcompile.scheduling.warmup_orders import WarmupSchedule
from pdcompile.scheduling.weight_policy import WeightPolicy

__all__ = [
    "Action",
    "ClosedForms",
    "PipelineSchedule",
    "Placement",
    "Schedule",
    "WarmupSchedule",
    "WeightPolicy",
    "build_schedule",
    "check_nonfinite",
    "forward_schedule",
    "get_schedule",
    "replica_orders",
    "register_schedule",
    "schedules",
]
