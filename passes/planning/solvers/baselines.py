"""Baselines the other pipeline systems use, as pdcompile solvers. Torch-free.

All three put one stage on each device (one replica each) along the graph's order, data sources
in the first stage:
- `uniform`: equal node counts per stage, as Megatron-LM splits layers evenly;
- `params`: balanced parameter bytes, DeepSpeed's default `partition_method="parameters"`;
- `blocks`: balanced forward + backward time, torchgpipe's balance-by-time block partition
  (solved exactly here: the smallest possible largest block).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdcompile.core.cluster import Cluster
from pdcompile.core.cost_graph import CostGraph
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.solver_kit import make_plan, register_solver
from pdcompile.passes.planning.solvers.orders import min_max_partition, split_sources


def _one_stage_per_device(
    cost_graph: CostGraph,
    cluster: Cluster,
    weight: Callable[[dict[str, Any]], float],
    options: dict[str, Any],
    name: str,
) -> Plan:
    """Contiguous stages of the graph's order, one per device, balancing `weight` per node."""
    sources, body = split_sources(cost_graph, cost_graph.nodes)
    body = body or sources
    sources = [n for n in sources if n not in body]
    weights = [weight(cost_graph.graph.nodes[n]) for n in body]
    bounds = [*min_max_partition(weights, cluster.num_devices), len(body)]
    groups = [body[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]
    groups[0] = sources + groups[0]
    return make_plan(cost_graph, cluster, [(nodes, 1) for nodes in groups], options, name)


@register_solver("uniform")
def uniform(cost_graph: CostGraph, cluster: Cluster, options: dict[str, Any]) -> Plan:
    """One stage per device with equal node counts (Megatron-LM's even split)."""
    return _one_stage_per_device(cost_graph, cluster, lambda a: 1.0, options, "uniform")


@register_solver("params")
def params(cost_graph: CostGraph, cluster: Cluster, options: dict[str, Any]) -> Plan:
    """One stage per device with balanced parameter bytes (DeepSpeed's default)."""
    return _one_stage_per_device(
        cost_graph, cluster, lambda a: float(a["param_bytes"]), options, "params"
    )


@register_solver("blocks")
def blocks(cost_graph: CostGraph, cluster: Cluster, options: dict[str, Any]) -> Plan:
    """One stage per device with balanced compute time (torchgpipe's balance by time)."""
    return _one_stage_per_device(
        cost_graph, cluster, lambda a: a["forward_s"] + a["backward_s"], options, "blocks"
    )
