"""Baselines the other pipeline systems use, as pdcompile solvers. Torch-free.

All three put one stage on each device (one replica each) along the graph's order, data sources
in the first stage:
- `uniform`: equal node counts per stage, as Megatron-LM splits layers evenly;
- `params`: balanced parameter bytes, DeepSpeed's default `partition_method="parameters"`;
- `blocks`: balanced forward + backward time, torchgpipe's balance-by-time block partition
  (solved exactly here: the smallest possible largest block).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdcompile.cluster import Cluster
from pdcompile.cost_graph import CostGraph
from pdcompile.passes.solvers.orders import graph_order, min_max_partition
from pdcompile.planning import make_plan, register_solver
from pdcompile.plans import Plan


def _one_stage_per_device(
    cost_graph: CostGraph, cluster: Cluster, weights: Sequence[float], options: dict, name: str
) -> Plan:
    order = graph_order(cost_graph)
    g = cost_graph.graph
    sources = sum(1 for n in order if g.nodes[n]["kind"] == "input" and g.in_degree(n) == 0)
    body = order[sources:] or order
    starts = min_max_partition(list(weights[len(order) - len(body) :]), cluster.num_devices)
    bounds = [*starts, len(body)]
    groups = [list(body[bounds[i] : bounds[i + 1]]) for i in range(len(starts))]
    groups[0] = order[: len(order) - len(body)] + groups[0]
    return make_plan(cost_graph, cluster, [(nodes, 1) for nodes in groups], options, name)


def _weights(cost_graph: CostGraph, key: str) -> list[float]:
    attrs = cost_graph.graph.nodes
    order = graph_order(cost_graph)
    if key == "count":
        return [1.0] * len(order)
    if key == "params":
        return [float(attrs[n]["param_bytes"]) for n in order]
    return [attrs[n]["forward_s"] + attrs[n]["backward_s"] for n in order]


@register_solver("uniform")
def uniform(cost_graph: CostGraph, cluster: Cluster, options: dict[str, Any]) -> Plan:
    """One stage per device with equal node counts (Megatron-LM's even split)."""
    return _one_stage_per_device(
        cost_graph, cluster, _weights(cost_graph, "count"), options, "uniform"
    )


@register_solver("params")
def params(cost_graph: CostGraph, cluster: Cluster, options: dict[str, Any]) -> Plan:
    """One stage per device with balanced parameter bytes (DeepSpeed's default)."""
    return _one_stage_per_device(
        cost_graph, cluster, _weights(cost_graph, "params"), options, "params"
    )


@register_solver("blocks")
def blocks(cost_graph: CostGraph, cluster: Cluster, options: dict[str, Any]) -> Plan:
    """One stage per device with balanced compute time (torchgpipe's balance by time)."""
    return _one_stage_per_device(
        cost_graph, cluster, _weights(cost_graph, "time"), options, "blocks"
    )
