"""`pdcompile.plan`, the solver registry (`register_solver`, `solvers`). Torch-free.

A solver is a pure function `fn(cost_graph, cluster, options: dict) -> Plan`. `options` holds the
caller's solver options plus `schedule` and `num_microbatches`, already resolved. Solvers price
stages with the cost model (`pdcompile.cost_model`) and build their plan with `make_plan`, which
places stages on consecutive ranks and prices them with the cost model (`evaluation.price`), so
every solver is compared on the same yardstick; `plan()` simulates the plan it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from pdcompile.cluster import Cluster
from pdcompile.cost_graph import CostGraph
from pdcompile.errors import PartitionError, ScheduleError
from pdcompile.evaluation import price, simulated
from pdcompile.plans import Plan, Stage, consecutive_ranks
from pdcompile.registry import Registry
from pdcompile.schedules import PipelineSchedule, get_schedule

Solver = Callable[[CostGraph, Cluster, dict[str, Any]], Plan]
# options `plan()` adds for every solver: the schedule, the microbatches searched with, and the
# replica counts allowed (absent: all; a count the caller gave may rule some out)
SEARCH = ("schedule", "num_microbatches", "replica_counts")

SOLVERS: Registry[Solver] = Registry(
    "solver",
    (
        "pdcompile.passes.solvers.baselines",
        "pdcompile.passes.solvers.dp",
        "pdcompile.passes.solvers.pipedream",
        "pdcompile.passes.solvers.ideal",
        "pdcompile.passes.solvers.cpsat",
    ),
    PartitionError,
)


def register_solver(name: str) -> Callable[[Solver], Solver]:
    """Register `fn(cost_graph, cluster, options) -> Plan` under `name` (its docstring's first
    line is its description in `solvers()` and `pdcompile solvers`)."""

    def decorate(fn: Solver) -> Solver:
        SOLVERS.add(name, fn)
        return fn

    return decorate


def solvers() -> dict[str, str]:
    """Registered solver names -> one-line descriptions."""
    return SOLVERS.describe()


def make_plan(
    cost_graph: CostGraph,
    cluster: Cluster,
    groups: Sequence[tuple[Sequence[str], int]],
    options: dict[str, Any],
    solver: str,
) -> Plan:
    """A plan from `(nodes, replicas)` per stage in pipeline order, on consecutive ranks,
    priced (`evaluation.price`; `plan()` simulates the one it returns) at the first microbatch
    count from `options["num_microbatches"]` on that the schedule accepts for these replicas
    (`plan()` refuses a count the caller gave that it does not)."""
    ranks = consecutive_ranks([r for _, r in groups])
    if ranks and ranks[-1] and ranks[-1][-1] >= cluster.num_devices:
        raise PartitionError(
            f"{solver}: the stages need {ranks[-1][-1] + 1} devices, the cluster has "
            f"{cluster.num_devices}"
        )
    stages = tuple(
        Stage(index=i, nodes=tuple(nodes), replicas=r, ranks=ranks[i])
        for i, (nodes, r) in enumerate(groups)
    )
    rules = get_schedule(options["schedule"])
    m = rules.accepted_microbatches([r for _, r in groups], options["num_microbatches"])
    skeleton = Plan(
        stages=stages,
        cluster=cluster,
        schedule=rules.name,
        num_microbatches=m,
        microbatch_size=cost_graph.batch_size,
        solver=solver,
        options={k: v for k, v in options.items() if k not in SEARCH},
    )
    return price(skeleton, cost_graph)


def plan(
    cost_graph: CostGraph,
    cluster: Cluster | str,
    *,
    solver: str = "dp",
    schedule: str | PipelineSchedule = "1f1b",
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    **options: Any,
) -> Plan:
    """Cut `cost_graph` into pipeline stages with replica counts for `cluster`.

    Args:
        cost_graph: costs per node (from `analyze`, `CostGraph.load` or `from_pipedream`).
        cluster: the devices (a `Cluster` or its text, e.g. "8@300GB/s,2@25Gbit/s").
        solver: a name from `solvers()`.
        schedule: a name from `pdcompile.schedules()` ("1f1b", "gpipe", "pipedream", "2bw", ...).
        num_microbatches: microbatches per step (default: twice the number of devices, rounded
            up to the next count the schedule accepts for the plan's replicas). `compile` runs
            what is chosen here.
        microbatch_size: rows per microbatch; the costs are scaled linearly from the graph's
            batch size.
        options: the solver's own options.

    Returns:
        The Plan, with `solve_time_s` set.

    Raises:
        PartitionError: unknown solver or schedule, or no plan exists (the message says why).
    """
    solve = SOLVERS.get(solver)
    cluster = Cluster.coerce(cluster)
    try:
        rules = get_schedule(schedule)
    except ScheduleError as exc:
        raise PartitionError(str(exc)) from None
    if cost_graph.graph.number_of_nodes() == 0:
        raise PartitionError("the cost graph has no nodes; nothing to plan")
    if microbatch_size is not None and microbatch_size != cost_graph.batch_size:
        cost_graph = cost_graph.scaled(microbatch_size)
    if num_microbatches is not None and num_microbatches < 1:
        raise PartitionError(f"num_microbatches must be >= 1, got {num_microbatches}")
    # solvers search with twice the devices; the count the plan runs is settled after. A
    # count the caller gave limits the replicas to those the schedule accepts with it
    searched = num_microbatches or 2 * cluster.num_devices
    options = {**options, "schedule": rules.name, "num_microbatches": searched}
    counts = range(1, cluster.num_devices + 1)
    if num_microbatches is not None and not all(rules.accepts([r], searched) for r in counts):
        options["replica_counts"] = tuple(r for r in counts if rules.accepts([r], searched))
    start = time.perf_counter()
    result = solve(cost_graph, cluster, options)
    seconds = time.perf_counter() - start
    _check_tied_replicas(result, solver, rules)
    if num_microbatches is not None and result.num_microbatches != num_microbatches:
        try:  # the schedule's own reason
            rules.check([s.replicas for s in result.stages], num_microbatches)
        except ScheduleError as exc:
            raise PartitionError(f"solver {solver!r} found {result.num_stages} stages, but "
                                 f"{exc}") from None  # fmt: skip
    return simulated(result).with_(solve_time_s=seconds)


def _check_tied_replicas(plan: Plan, solver: str, rules: PipelineSchedule) -> None:
    """A schedule that does not replicate ties needs one replica on each stage holding a tied
    tensor's copy (`pipedream`: replicas update once per round of them, so a replicated copy
    would update at another pace)."""
    if rules.replicates_ties:
        return
    for stages, _ in plan.ties:
        for s in stages:
            if plan.stages[s].replicas > 1:
                raise PartitionError(
                    f"solver {solver!r} gave stage {s} {plan.stages[s].replicas} replicas, but it "
                    f"holds a copy of a tensor that stages {list(stages)} share (tied weights): "
                    f"under {rules.name} such a stage needs one replica; use solver 'dp', which "
                    "keeps to this, or a schedule that replicates ties (e.g. '2bw')"
                )
