"""`PlanConfig`: how a plan is made (`plan`) or which plan runs (`compile(plan=)`), checked
once, when it is built. Torch-free."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pdcompile.core.cluster import AUTO as MEASURED
from pdcompile.core.cluster import Cluster
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import ConfigError, PdcompileError, PlanConfigError
from pdcompile.passes.planning.plans import Plan
from pdcompile.scheduling import PipelineSchedule, get_schedule
from pdcompile.scheduling.base import MAX_MICROBATCHES

AUTO = "auto"  # schedule="auto": the planner chooses (`search.schedule_choice`)


@dataclass(frozen=True)
class PlanConfig:
    """The planning settings: `plan`'s keywords and `compile`'s of the same names.

    Attributes:
        cluster: the devices (a `Cluster`, its text or a number of devices: `Cluster.coerce`,
            read once here); None or "auto" (`compile` only): in a job of two or more ranks,
            the job measures its hosts, links, rank speeds and memory before planning
            (`runtime/cluster_measure.py`, cached for a day; `explain()` says how), else one
            device; a given `plan` keeps its own cluster.
        schedule: a name from `pdcompile.schedules()` (looked up once here) or a
            `PipelineSchedule`: "1f1b" (default: synchronous, equal to single-process gradient
            accumulation), "gpipe", "pipedream" (asynchronous, weight stashing), "2bw", or one
            registered with `pdcompile.register_schedule`; "auto": every synchronous schedule
            (and chunks per rank it takes) planned, the fastest `step_time` that fits memory
            kept, with the comparison in `options["auto"]` (`search.schedule_choice`;
            `explain()` shows it); under `compile` a given `plan` runs its own schedule.
        solver: the partitioning solver (`pdcompile.solvers()`; "dp", the old name of
            "dynprog", still works).
        num_microbatches: microbatches per step, at most `MAX_MICROBATCHES` (65536; default:
            twice the number of devices, within that cap, rounded up to the next count the
            schedule accepts for the plan's replicas, and to one that every replica count
            divides if that is less than one round of the largest count further:
            `settled_microbatches`); under `compile`, a count that differs from a given plan's
            re-scores it.
        microbatch_size: rows per microbatch (an integer >= 1; `plan` only); the costs are
            scaled from the graph's batch size.
        replica_counts: the replica counts a stage may have (default: any; `plan` only); e.g.
            the divisors of `num_microbatches`. Solvers `dynprog`, `ideal` and `cpsat` search
            within them; a plan from another solver that breaks them is refused.
        chunks: stages per rank, one replica each (`plan` only; default: the schedule's
            `default_chunks`, 2 for `interleaved-1f1b` and `zb-v`, else 1), placed by the
            schedule (`PipelineSchedule.chunk_rank`).
        allow_async: with schedule="auto", the asynchronous schedules (`pipedream`, `2bw`) are
            candidates too (they change the optimisation's semantics).
        global_batch_size: rows per `train_step`. Without `num_microbatches` (or
            `microbatch_size`), every count M dividing it that the schedule accepts is planned
            at G / M rows per microbatch, the fastest fitting plan kept, the counts tried in
            `options["microbatches"]` (`search.microbatch_count`; with "auto", for every
            candidate schedule). None: the example is one microbatch.
        memory: bytes per device (a number or a size such as "16GB"), overriding
            `cluster.memory`; "auto": this host's available RAM over the devices of the
            cluster's innermost level, less 10% (`search.recompute_choice.host_memory`; under
            `compile`, rank 0's device's: CUDA's total memory, CPU's available RAM per rank).
            A limit no plan fits raises `PartitionError`, naming the least memory a plan needs.
        recompute: activation recomputation (`Stage.recompute`, docs/memory.md): None, the
            planner recomputes the stages that need it to fit the memory limit where that is
            the fastest plan; True, every stage; False, none (`options["recomputation"]`).
        profile: `compile` measures node times (False: analytic costs, e.g. for meta-device
            models).
        costs: a CostGraph (or its JSON file) of the model for `compile` to plan with instead
            of profiling it (e.g. `pdcompile profile --out costs.json` run once).
        plan: a Plan (or a saved plan's path) for `compile` to run: no profile, no solving.
        solver_options: the solver's own options (`plan`'s other keywords).

    `dataclasses.replace` (`replace`) checks the fields again without reading anything twice:
    a `Cluster` and a `PipelineSchedule` are taken as they are.

    Raises:
        ConfigError: (a `PartitionError` too) any field out of range, naming it, the value and
            the remedy.
    """

    cluster: Cluster | None = None
    schedule: PipelineSchedule | str = "1f1b"
    solver: str = "dynprog"
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    replica_counts: tuple[int, ...] | None = None
    chunks: int | None = None
    allow_async: bool = False
    global_batch_size: int | None = None
    memory: float | str | None = None
    recompute: bool | None = None
    profile: bool = True
    costs: CostGraph | str | None = None
    plan: Plan | str | None = None
    solver_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, check in _CHECKS.items():
            object.__setattr__(self, name, check(getattr(self, name)))

    @property
    def auto(self) -> bool:
        """Whether the planner chooses the schedule."""
        return isinstance(self.schedule, str)

    @property
    def rules(self) -> PipelineSchedule:
        """The schedule (not "auto": the plan then says which)."""
        assert isinstance(self.schedule, PipelineSchedule), "schedule='auto' has no rules"
        return self.schedule

    def replace(self, **changes: Any) -> PlanConfig:
        """This config with `changes` (checked)."""
        return dataclasses.replace(self, **changes)


# a layer of `plan()`: what plans a cost graph under a config (the searches take the next one)
Planner = Callable[[CostGraph, "PlanConfig"], Plan]


def _read(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`check` (a phase's own check), its error raised as a `PlanConfigError`."""

    def checked(value: Any) -> Any:
        try:
            return check(value)
        except ConfigError:
            raise
        except PdcompileError as exc:
            raise PlanConfigError(str(exc)) from None

    return checked


@_read
def _cluster(value: Any) -> Cluster | None:
    if value is None or (isinstance(value, str) and value == MEASURED):
        return None
    return value if isinstance(value, Cluster) else Cluster.coerce(value)


@_read
def _schedule(value: Any) -> PipelineSchedule | str:
    if isinstance(value, str) and value == AUTO:
        return value
    if not isinstance(value, (str, PipelineSchedule)):
        raise PlanConfigError(
            f"schedule must be a name from pdcompile.schedules(), a PipelineSchedule or 'auto', "
            f"got {type(value).__name__} {value!r}"
        )
    return value if isinstance(value, PipelineSchedule) else get_schedule(value)


@_read
def _solver(value: Any) -> str:
    from pdcompile.passes.planning.solver_kit import SOLVERS  # the registry imports this module

    SOLVERS.get(value)
    return value


def _count(what: str, cap: int | None) -> Callable[[Any], int | None]:
    """A check of a count of microbatches or rows (`check_num_microbatches`), None allowed."""

    @_read
    def check(value: Any) -> int | None:
        from pdcompile.passes.planning.validate import check_num_microbatches

        return None if value is None else check_num_microbatches(value, what, cap)

    return check


def _replica_counts(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    counts = tuple(value) if isinstance(value, (list, tuple, range, set, frozenset)) else None
    if not counts or not all(_integer(r) and r >= 1 for r in counts):
        raise PlanConfigError(
            f"replica_counts must be a non-empty sequence of integers >= 1 (e.g. (1, 2, 4) for "
            f"8 microbatches), got {value!r}"
        )
    return counts


def _chunks(value: Any) -> int | None:
    if value is not None and not (_integer(value) and value >= 1):
        raise PlanConfigError(
            f"chunks must be an integer >= 1 (stages per rank) or None (the schedule's "
            f"default), got {value!r}"
        )
    return value


def _flag(name: str, meaning: str) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise PlanConfigError(f"{name} must be True or False ({meaning}), got {value!r}")
        return value

    return check


def _global_batch_size(value: Any) -> int | None:
    if value is not None and not (_integer(value) and value >= 1):
        raise PlanConfigError(
            f"global_batch_size must be an integer >= 1 (rows per train_step) or None, got "
            f"{value!r}"
        )
    return value


@_read
def _memory(value: Any) -> float | str | None:
    from pdcompile.passes.planning.recompute_choice import check_memory

    check_memory(value)
    return value


@_read
def _recompute(value: Any) -> bool | None:
    from pdcompile.passes.planning.recompute_choice import check_recompute

    check_recompute(value)
    return value


def _loaded(name: str, kind: type) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value is None or isinstance(value, kind):
            return value
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
        raise PlanConfigError(
            f"{name} must be a {kind.__name__}, the path of its JSON file, or None, got "
            f"{type(value).__name__}"
        )

    return check


def _solver_options(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise PlanConfigError(f"solver_options must be a mapping of names, got {value!r}")
    return MappingProxyType(dict(value))


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "cluster": _cluster,
    "schedule": _schedule,
    "solver": _solver,
    "num_microbatches": _count("num_microbatches", MAX_MICROBATCHES),
    "microbatch_size": _count("microbatch_size", None),
    "replica_counts": _replica_counts,
    "chunks": _chunks,
    "allow_async": _flag("allow_async", "whether schedule='auto' may pick pipedream or 2bw"),
    "global_batch_size": _global_batch_size,
    "memory": _memory,
    "recompute": _recompute,
    "profile": _flag("profile", "False: analytic costs"),
    "costs": _loaded("costs", CostGraph),
    "plan": _loaded("plan", Plan),
    "solver_options": _solver_options,
}
