"""`pipedream`: PipeDream's own hierarchical optimizer, as a pdcompile solver. Torch-free.

The optimizer (`pipedream_optimizer.py`, docs/pipedream_solver.md) reproduces the original's
plans and its printed "Time per stage in pipeline", quirks included; that time is the plan's
`predicted_time` (and `gap`, `data_parallel_time` are PipeDream's too, so the printed speed-up is
its `speedup_vs_dp`). The optimizer keeps PipeDream's own stage cost (that is what it
reproduces); `options["cost_model"]` (default "pdcompile") prices the plan's stages afterwards, and
`evaluate(plan, ...)` and `pdcompile compare` re-score the whole plan on that common yardstick
(`options["evaluate_predicted_time"]` keeps it).
"""

from __future__ import annotations

from typing import Any

from pdcompile.core.cluster import Cluster
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError
from pdcompile.passes.planning.cost_model import get_cost_model
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.solver_kit import SEARCH, make_plan, register_solver
from pdcompile.passes.planning.solvers.pipedream_optimizer import optimize_pipedream

# The original's command-line defaults.
DEFAULTS = {
    "straight": False,
    "memory_constraint": False,
    "memory_size": 16e9,
    "use_fewer_machines": False,
    "activation_compression_ratio": None,
}


@register_solver("pipedream")
def pipedream(cost_graph: CostGraph, cluster: Cluster, options: dict[str, Any]) -> Plan:
    """PipeDream's hierarchical antichain DP, reproduced exactly (its cost model and quirks)."""
    own = {k: v for k, v in options.items() if k not in SEARCH}
    unknown = set(own) - {*DEFAULTS, "cost_model"}
    if unknown:
        raise PartitionError(
            f"pipedream: unknown options {sorted(unknown)}; it takes {', '.join(DEFAULTS)}, "
            "cost_model"
        )
    get_cost_model(own.get("cost_model", "pdcompile"))  # an unknown name fails before solving
    settings = {**DEFAULTS, **own}
    if cluster.memory is not None and "memory_size" not in own:
        settings["memory_size"] = cluster.memory
    result = optimize_pipedream(
        cost_graph,
        [level.count for level in cluster.levels],
        [level.bandwidth for level in cluster.levels],
        straight_pipeline=settings["straight"],
        use_memory_constraint=settings["memory_constraint"],
        memory_size=settings["memory_size"],
        use_fewer_machines=settings["use_fewer_machines"],
        activation_compression_ratio=settings["activation_compression_ratio"],
    )
    plan = make_plan(cost_graph, cluster, result.stages, options, "pipedream")
    return plan.with_(
        predicted_time=result.time_per_stage,
        gap=result.time_per_stage / plan.lower_bound - 1 if plan.lower_bound else 0.0,
        data_parallel_time=result.data_parallel_time,
        options={
            **settings,
            "evaluate_predicted_time": plan.predicted_time,
            "pipedream_data_parallel_time": result.data_parallel_time,
            "num_states": result.num_states,
        },
    )
