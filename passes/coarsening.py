"""Coarsening: group a CostGraph's nodes into at most `max_layers` layers so plans come quickly.

Every layer is a contiguous interval of a topological order, so every layer is convex (no path
leaves it and comes back) and the graph of layers is acyclic, even where a module is called twice.
Cuts between different modules are kept longest, cuts between the most distant modules longest
of all; among equally deep cuts the pair of neighbouring layers with the least compute is merged
first. Torch-free. docs/cost_graph.md describes the algorithm.
"""

from __future__ import annotations

import heapq
import math

from pdcompile.core.cost_attrs import TIME_ATTRS
from pdcompile.core.cost_graph import FLOAT_ATTRS, INT_ATTRS, CostGraph
from pdcompile.core.errors import CostError
from pdcompile.core.row_curves import node_points

__all__ = ["coarsen"]

_SAME_SCOPE = 1 << 30  # depth of a cut between two nodes of the same module: merged first
_AFTER_INPUTS = -1  # depth of the cut after the input layer: merged last


def coarsen(cost_graph: CostGraph, max_layers: int) -> CostGraph:
    """Group the nodes into at most `max_layers` layers, each a contiguous run of the node order.

    Input nodes (kind "input" with no predecessors) move to the front of the order, and the cut
    after them is removed last, only when `max_layers` is 1: the first layer (or layers, when
    there is room) holds only inputs and has kind "input", which solvers give zero compute and
    keep with the first stage, as PipeDream does; data loading never counts as a stage's compute.
    The other cuts are removed deepest module boundary first (a cut inside one module before a
    cut between two blocks, that before a cut between two top-level modules; cuts between nodes
    of the same module first of all), and among cuts of equal depth the one whose two layers
    have the least `forward_s + backward_s` (ties: earliest), until `max_layers` layers remain.

    A layer's times (`optimizer_s` too), bytes and flops are the sums of its members'
    (`math.fsum`, so totals agree with the original's to the last bits; byte counts exactly),
    its `forward_spread` and `backward_spread` their members' weighted by `forward_s` and
    `backward_s`, its `members`
    the concatenation of theirs, its `scope` their longest common module path, its `kind` "input"
    or "output" only if all members are. The bytes of the edge A -> B are, summed over the
    producers u in A that feed B, the largest `bytes` of u's edges into B: a tensor goes to a
    layer once however many of its nodes read it.

    Args:
        cost_graph: the graph to coarsen (not modified).
        max_layers: the most layers to keep, >= 1.

    Returns:
        A new CostGraph with layers "L000", "L001", ... in topological order and
        `meta["coarsened_from"]` = the number of original nodes and the original's loss and
        optimizer (`CostGraph.step_costs`); an equal copy of `cost_graph`
        if it has at most `max_layers` nodes.

    Raises:
        CostError: `max_layers` is not an integer >= 1.

    Example:
        >>> layers = coarsen(CostGraph.from_pipedream("resnet50/graph.txt", batch_size=128), 16)
        >>> len(layers.nodes), layers.graph.nodes["L000"]["kind"]
        (16, 'input')
    """
    if isinstance(max_layers, bool) or not isinstance(max_layers, int) or max_layers < 1:
        raise CostError(f"coarsen: max_layers must be an integer >= 1, got {max_layers!r}")
    if max_layers >= cost_graph.graph.number_of_nodes():
        return cost_graph.copy()
    order, depths = _order_and_cut_depths(cost_graph)
    weights = [
        cost_graph.graph.nodes[n]["forward_s"] + cost_graph.graph.nodes[n]["backward_s"]
        for n in order
    ]
    intervals = _merge(depths, weights, max_layers)
    return _build(cost_graph, [order[start : end + 1] for start, end in intervals])


def _order_and_cut_depths(cost_graph: CostGraph) -> tuple[list[str], list[int]]:
    """The order to cut (input sources first) and, per cut between neighbours, its depth."""
    g = cost_graph.graph
    inputs = [n for n in g if g.nodes[n]["kind"] == "input" and g.in_degree(n) == 0]
    is_input = set(inputs)
    order = inputs + [n for n in g if n not in is_input]
    depths = []
    for i in range(len(order) - 1):
        a, b = order[i], order[i + 1]
        if a in is_input:
            depths.append(_SAME_SCOPE if b in is_input else _AFTER_INPUTS)
        else:
            depths.append(_shared_depth(g.nodes[a]["scope"], g.nodes[b]["scope"]))
    return order, depths


def _shared_depth(a: str, b: str) -> int:
    """How many leading module names two scopes share (`_SAME_SCOPE` if they are equal)."""
    if a == b:
        return _SAME_SCOPE
    return len(_common_prefix([a.split(".") if a else [], b.split(".") if b else []]))


def _common_prefix(paths: list[list[str]]) -> list[str]:
    prefix = paths[0]
    for path in paths[1:]:
        n = 0
        while n < min(len(prefix), len(path)) and prefix[n] == path[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def _merge(depths: list[int], weights: list[float], max_layers: int) -> list[tuple[int, int]]:
    """Remove cuts (deepest first, then lightest pair, then earliest) until max_layers remain.

    Intervals are keyed by their first position; a heap entry for the cut after position `cut`
    is stale once either interval beside it has changed (its stamp moved on).
    """
    n = len(weights)
    end = list(range(n))  # end[start] = last position of the interval starting at `start`
    weight = list(weights)
    prev = [i - 1 for i in range(n)]  # start of the interval before the one starting here
    stamp = [0] * n
    alive = [True] * n
    heap = [(-depths[i], weights[i] + weights[i + 1], i, 0, 0) for i in range(n - 1)]
    heapq.heapify(heap)
    count = n
    while count > max_layers:
        _, _, cut, left_stamp, right_stamp = heapq.heappop(heap)
        right = cut + 1
        left = prev[right]
        if not (alive[right] and left >= 0 and end[left] == cut):
            continue
        if (stamp[left], stamp[right]) != (left_stamp, right_stamp):
            continue
        end[left], weight[left] = end[right], weight[left] + weight[right]
        alive[right] = False
        stamp[left] += 1
        count -= 1
        after = end[left] + 1
        if after < n:
            prev[after] = left
            entry = (-depths[after - 1], weight[left] + weight[after], after - 1)
            heapq.heappush(heap, (*entry, stamp[left], stamp[after]))
        if left > 0:
            before = prev[left]
            entry = (-depths[left - 1], weight[before] + weight[left], left - 1)
            heapq.heappush(heap, (*entry, stamp[before], stamp[left]))
    return [(start, end[start]) for start in range(n) if alive[start]]


def _weighted_spread(data: list[dict], spread: str, time: str) -> float:
    """A layer's spread: its members' weighted by their times (what the spread of the sum is
    when the members' repeats vary together; less when they vary independently)."""
    total = math.fsum(d[time] for d in data)
    if total <= 0:
        return max((d[spread] for d in data), default=0.0)
    return math.fsum(d[spread] * d[time] for d in data) / total


def _summed_points(cost_graph: CostGraph, data: list[dict]) -> tuple | None:
    """A layer's times at each of the graph's row counts: its members' summed (a member without
    them counted linearly, as `scaled` counts it); None when no member has them."""
    if not any(d["row_s"] is not None for d in data):
        return None
    rows, batch = cost_graph.rows, cost_graph.batch_size
    members = [node_points(rows, batch, d["row_s"], [d[t] for t in TIME_ATTRS]) for d in data]
    return tuple(
        tuple(math.fsum(m[i][k] for m in members) for k in range(len(TIME_ATTRS)))
        for i in range(len(rows))
    )


def _build(cost_graph: CostGraph, groups: list[list[str]]) -> CostGraph:
    g = cost_graph.graph
    width = max(3, len(str(len(groups) - 1)))
    ids = [f"L{k:0{width}d}" for k in range(len(groups))]
    layer_of = {node: k for k, group in enumerate(groups) for node in group}
    meta = {k: v for k, v in cost_graph.meta.items() if k != "pipedream"}  # names old nodes
    meta["coarsened_from"] = sum(len(members) for _, members in g.nodes(data="members"))
    out = CostGraph(batch_size=cost_graph.batch_size, meta=meta, **cost_graph.step_costs())
    for k, group in enumerate(groups):
        data = [g.nodes[n] for n in group]
        attrs = {name: math.fsum(d[name] for d in data) for name in FLOAT_ATTRS}
        attrs.update({name: sum(d[name] for d in data) for name in INT_ATTRS})
        for spread, time in (("forward_spread", "forward_s"), ("backward_spread", "backward_s")):
            attrs[spread] = _weighted_spread(data, spread, time)
        del attrs["memory_bytes"]
        attrs["row_s"] = _summed_points(cost_graph, data)
        if len(group) == 1:
            keep = ("kind", "description", "scope", "members", "activation_sizes")
            out.add_node(ids[k], **attrs, **{name: data[0][name] for name in keep})
            continue
        kinds = {d["kind"] for d in data}
        scope = ".".join(
            _common_prefix([d["scope"].split(".") if d["scope"] else [] for d in data])
        )
        span = f"{len(group)} nodes {group[0]}..{group[-1]}"
        out.add_node(
            ids[k],
            **attrs,
            kind=kinds.pop() if len(kinds) == 1 else "compute",
            description=f"{scope}: {span}" if scope else span,
            scope=scope,
            members=tuple(m for d in data for m in d["members"]),
        )
    sent: dict[tuple[int, int, str], int] = {}  # (layer of u, layer of v, u) -> bytes
    grads: dict[tuple[int, int], bool] = {}  # whether any member edge carries a gradient
    for u, v, data in g.edges(data=True):
        key = (layer_of[u], layer_of[v], u)
        if key[0] != key[1]:
            sent[key] = max(sent.get(key, 0), data["bytes"])
            grads[key[:2]] = grads.get(key[:2], False) or data["grad"]
    edges: dict[tuple[int, int], int] = {}
    for (a, b, _), nbytes in sent.items():
        edges[(a, b)] = edges.get((a, b), 0) + nbytes
    for a, b in sorted(edges):
        out.add_edge(ids[a], ids[b], edges[(a, b)], grads[(a, b)])
    return out
