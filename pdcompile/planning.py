"""`pdcompile.plan`, the solver registry (`register_solver`, `solvers`). Torch-free.

A solver is a pure function `fn(cost_graph, cluster, options: dict) -> Plan`. `options` holds the
caller's solver options plus `schedule` and `num_microbatches`, already resolved. Solvers build
their plan with `make_plan`, which places stages on consecutive ranks and scores them with
pdcompile's cost model (`evaluate`), so every solver is compared on the same yardstick.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from pdcompile.cluster import Cluster
from pdcompile.cost_graph import CostGraph
from pdcompile.cost_model import evaluate
from pdcompile.errors import PartitionError
from pdcompile.plans import Plan, Stage, check_schedule, consecutive_ranks

Solver = Callable[[CostGraph, Cluster, dict[str, Any]], Plan]

_REGISTRY: dict[str, Solver] = {}
_BUILTINS = (
    "pdcompile.passes.solvers.baselines",
    "pdcompile.passes.solvers.dp",
    "pdcompile.passes.solvers.pipedream",
    "pdcompile.passes.solvers.ideal",
    "pdcompile.passes.solvers.cpsat",
)


def register_solver(name: str) -> Callable[[Solver], Solver]:
    """Register `fn(cost_graph, cluster, options) -> Plan` under `name` (its docstring's first
    line is its description in `solvers()` and `pdcompile solvers`)."""

    def decorate(fn: Solver) -> Solver:
        _REGISTRY[name] = fn
        return fn

    return decorate


def _load_builtins() -> None:
    for module in _BUILTINS:
        importlib.import_module(module)


def solvers() -> dict[str, str]:
    """Registered solver names -> one-line descriptions."""
    _load_builtins()
    return {
        name: (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        for name, fn in sorted(_REGISTRY.items())
    }


def make_plan(
    cost_graph: CostGraph,
    cluster: Cluster,
    groups: Sequence[tuple[Sequence[str], int]],
    options: dict[str, Any],
    solver: str,
) -> Plan:
    """A plan from `(nodes, replicas)` per stage in pipeline order, on consecutive ranks, scored."""
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
    skeleton = Plan(
        stages=stages,
        cluster=cluster,
        schedule=options["schedule"],
        num_microbatches=options["num_microbatches"],
        microbatch_size=cost_graph.batch_size,
        solver=solver,
        options={k: v for k, v in options.items() if k not in ("schedule", "num_microbatches")},
    )
    return evaluate(skeleton, cost_graph)


def plan(
    cost_graph: CostGraph,
    cluster: Cluster,
    *,
    solver: str = "dp",
    schedule: str = "1f1b",
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    **options: Any,
) -> Plan:
    """Cut `cost_graph` into pipeline stages with replica counts for `cluster`.

    Args:
        cost_graph: costs per node (from `analyze`, `CostGraph.load` or `from_pipedream`).
        cluster: the devices.
        solver: a name from `solvers()`.
        schedule: "1f1b", "gpipe", "pipedream" or "2bw".
        num_microbatches: microbatches per step (default: twice the number of devices, an upper
            bound of twice the number of stages; under `pipedream` and `2bw` rounded up to
            whole rounds of every stage's replicas, which they need).
        microbatch_size: rows per microbatch; the costs are scaled linearly from the graph's
            batch size.
        options: the solver's own options.

    Returns:
        The Plan, with `solve_time_s` set.

    Raises:
        PartitionError: unknown solver or schedule, or no plan exists (the message says why).
    """
    _load_builtins()
    if solver not in _REGISTRY:
        raise PartitionError(
            f"unknown solver {solver!r}; registered: {', '.join(sorted(_REGISTRY))}"
        )
    check_schedule(schedule)
    if cost_graph.graph.number_of_nodes() == 0:
        raise PartitionError("the cost graph has no nodes; nothing to plan")
    if microbatch_size is not None and microbatch_size != cost_graph.batch_size:
        cost_graph = cost_graph.scaled(microbatch_size)
    if num_microbatches is not None and num_microbatches < 1:
        raise PartitionError(f"num_microbatches must be >= 1, got {num_microbatches}")
    options = {
        **options,
        "schedule": schedule,
        "num_microbatches": num_microbatches or 2 * cluster.num_devices,
    }
    start = time.perf_counter()
    result = _REGISTRY[solver](cost_graph, cluster, options)
    seconds = time.perf_counter() - start
    if num_microbatches is None:
        result = _whole_rounds(result, cost_graph)
    _check_tied_replicas(result, solver)
    return result.with_(solve_time_s=seconds)


def _check_tied_replicas(plan: Plan, solver: str) -> None:
    """Under `pipedream` a stage holding a tied tensor's copy must have one replica: replicas
    update once per round of them, so a replicated copy would update at another pace."""
    if plan.schedule != "pipedream":
        return
    for stages, _ in plan.ties:
        for s in stages:
            if plan.stages[s].replicas > 1:
                raise PartitionError(
                    f"solver {solver!r} gave stage {s} {plan.stages[s].replicas} replicas, but it "
                    f"holds a copy of a tensor that stages {list(stages)} share (tied weights): "
                    "under pipedream such a stage needs one replica; use solver 'dp', which "
                    "keeps to this, or schedule '2bw'"
                )


def _whole_rounds(plan: Plan, cost_graph: CostGraph) -> Plan:
    """A streaming plan with its default microbatch count rounded up to a multiple of every
    stage's replicas (`pipedream` updates once per round of them, `2bw` gives each as many);
    other plans as they are. `pipedream`'s predictions do not depend on the count (the
    solver's own estimate stays); `2bw`'s are re-scored."""
    period = math.lcm(*(s.replicas for s in plan.stages))
    m = plan.num_microbatches
    if plan.schedule not in ("pipedream", "2bw") or m % period == 0:
        return plan
    m = -(-m // period) * period
    if plan.schedule == "pipedream":
        return plan.with_(num_microbatches=m)
    return evaluate(plan, cost_graph, num_microbatches=m)
