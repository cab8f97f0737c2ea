"""Linear orders of a CostGraph, and contiguous partitions of them. Torch-free.

Solvers that cut a linear order keep data sources (kind "input" with no predecessors) first, so
they land in the first stage. For DAGs several topological orders are tried: the graph's own,
depth-first, breadth-first and critical-path (longest remaining compute first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import networkx as nx

from pdcompile.core.cost_graph import CostGraph


def split_sources(cost_graph: CostGraph, order: Sequence[str]) -> tuple[list[str], list[str]]:
    """`order` split into its data sources (kind "input", no predecessors) and the rest."""
    g = cost_graph.graph
    is_source = {n for n in order if g.nodes[n]["kind"] == "input" and g.in_degree(n) == 0}
    return [n for n in order if n in is_source], [n for n in order if n not in is_source]


def _with_sources_first(cost_graph: CostGraph, order: Sequence[str]) -> list[str]:
    sources, rest = split_sources(cost_graph, order)
    return sources + rest


def graph_order(cost_graph: CostGraph) -> list[str]:
    return _with_sources_first(cost_graph, cost_graph.nodes)


def _keyed_order(cost_graph: CostGraph, key: Callable[[str], object]) -> list[str]:
    return _with_sources_first(
        cost_graph, list(nx.lexicographical_topological_sort(cost_graph.graph, key=key))
    )


def linear_orders(cost_graph: CostGraph) -> dict[str, list[str]]:
    """Distinct topological orders by name: graph, dfs, bfs, critical_path."""
    g = cost_graph.graph
    position = {n: i for i, n in enumerate(cost_graph.nodes)}
    depth = {}
    for n in cost_graph.nodes:  # BFS level: longest path (in edges) from a source
        depth[n] = max((depth[p] + 1 for p in g.predecessors(n)), default=0)
    remaining: dict[str, float] = {}
    for n in reversed(cost_graph.nodes):  # compute on the longest path from n to a sink
        own = g.nodes[n]["forward_s"] + g.nodes[n]["backward_s"]
        remaining[n] = own + max((remaining[s] for s in g.successors(n)), default=0.0)
    dfs = list(nx.dfs_postorder_nodes(g.reverse(copy=False)))  # sinks' ancestors, depth first
    orders = {
        "graph": graph_order(cost_graph),
        "dfs": _with_sources_first(cost_graph, dfs),
        "bfs": _keyed_order(cost_graph, lambda n: (depth[n], position[n])),
        "critical_path": _keyed_order(cost_graph, lambda n: (-remaining[n], position[n])),
    }
    distinct: dict[str, list[str]] = {}
    for name, order in orders.items():
        if order not in distinct.values():
            distinct[name] = order
    return distinct


def min_max_partition(weights: Sequence[float], parts: int) -> list[int]:
    """Cut `weights` into at most `parts` non-empty contiguous blocks minimising the largest sum.

    Returns the start index of every block. Binary search on the largest sum with a greedy
    feasibility check; exact to a relative 1e-12 of the total.
    """
    n = len(weights)
    parts = max(1, min(parts, n))
    lo, hi = max(weights, default=0.0), float(sum(weights))

    def starts_for(limit: float) -> list[int]:
        starts, total = [0], 0.0
        for i, w in enumerate(weights):
            if total + w > limit and i > starts[-1]:
                starts.append(i)
                total = 0.0
            total += w
        return starts

    for _ in range(200):
        if hi - lo <= 1e-12 * max(hi, 1e-300):
            break
        mid = (lo + hi) / 2
        if len(starts_for(mid)) <= parts:
            hi = mid
        else:
            lo = mid
    starts = starts_for(hi)
    # Use every part: split the largest blocks further while blocks remain to give out.
    while len(starts) < parts:
        bounds = starts + [n]
        sizes = [bounds[i + 1] - bounds[i] for i in range(len(starts))]
        i = max(
            (i for i in range(len(starts)) if sizes[i] > 1), key=lambda i: sizes[i], default=None
        )
        if i is None:
            break
        starts.insert(i + 1, starts[i] + sizes[i] // 2)
    return starts
