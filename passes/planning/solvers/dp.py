"""`dynprog` (PipeDream's dynamic program; formerly `dp`): exact partitioning of a linear order
into stages with replicas, on pdcompile's cost model.

Stages are contiguous runs of a topological order; stage s gets r_s replicas on the next r_s
ranks (devices may stay unused at the end). The objective is `evaluate`'s predicted time (the
bottleneck stage time, docs/cost_model.md), reproduced term by term, so on one order the answer is
optimal for that model. For DAGs the graph's own, depth-first, breadth-first and critical-path
orders are each solved and the best plan is kept.

Two exact algorithms:
- **Homogeneous clusters without a memory limit** (any number of levels): bisection on the
  bottleneck with a fewest-devices DP over (prefix, first free rank mod the group size, span
  level of the last stage), in `bisection.py`. Thousands of nodes and devices in seconds.
- **Heterogeneous speeds or a memory limit**: a dynamic program over states (prefix end j,
  devices used m, span level of the last stage L); the transfer into a stage runs at the slowest
  level spanned by it and the stage before, which is max(L, level(m-1, m), L_new), so L is all
  the state it needs. O(N^2 M^2 L) with numpy over the stage end.

Stages are priced by the cost model (`options["cost_model"]`, default "pdcompile"). Memory
(when the cluster has a limit) is checked per stage with the schedule's `memory_bounds`: its
`memory_counts` as large as the devices after the stage allow (the later stages are not placed
yet) and, for the W's a split schedule leaves pending, the deepest warm-up the cluster's devices
allow before it (the earlier stages are not kept): weights + versions x params + (in flight +
deferred) x activations, less the gradients where the counts say the peak comes before the
first backward (`MemoryCounts.charges`). No plan over the limit under those counts is
returned, but one that fits may be missed.

Under a schedule that does not replicate ties (`replicates_ties`, e.g. `pipedream`) a stage
holding some but not all users of a tied tensor (the CostGraph's `meta["ties"]`) gets one
replica: replicas update once per round of them, so a replicated copy would update at another
pace than the others. Such graphs take the general DP.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pdcompile.core.cluster import Cluster
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError
from pdcompile.core.message_buffers import stage_bytes
from pdcompile.passes.planning.cost_model import Pricing
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.solver_kit import SEARCH, make_plan, register_solver
from pdcompile.passes.planning.solvers.bisection import ring_pace, solve_bisection
from pdcompile.passes.planning.solvers.orders import linear_orders
from pdcompile.passes.planning.solvers.reach import solve_reach
from pdcompile.passes.planning.stage_sums import edge_bytes
from pdcompile.scheduling.base import MemoryCounts

# the reach tables grow with the devices (a Python step per device count): past this many
# devices bisection over prefix ends is faster (100,000 devices: seconds against minutes)
REACH_DEVICES = 4096


class Prefix:
    """Prefix sums over one order, and the bytes crossing each cut."""

    def __init__(self, cost_graph: CostGraph, order: list[str]) -> None:
        g = cost_graph.graph
        attrs = [g.nodes[n] for n in order]
        compute = cost_graph.compute_times(order)  # the loss at the output's position
        self.compute = np.concatenate([[0.0], np.cumsum(compute)])
        self.grad = np.concatenate([[0], np.cumsum([a["grad_bytes"] for a in attrs])])
        self.params = np.concatenate([[0], np.cumsum([a["param_bytes"] for a in attrs])])
        weights = [a["param_bytes"] + a["grad_bytes"] + a["optimizer_bytes"] for a in attrs]
        self.weights = np.concatenate([[0], np.cumsum(weights)])
        self.activations = np.concatenate([[0], np.cumsum([a["activation_bytes"] for a in attrs])])
        position = {n: i for i, n in enumerate(order)}
        diff = np.zeros(len(order) + 2)
        for u in order:
            last = max((position[v] for v in g.successors(u)), default=position[u])
            if last > position[u]:
                nbytes = max(b for _, _, b in g.out_edges(u, data="bytes"))
                diff[position[u] + 1] += nbytes
                diff[last + 1] -= nbytes
        self.cut = np.cumsum(diff)[: len(order) + 1]  # cut[j]: bytes into position j
        self.edges = np.array(edge_bytes(cost_graph, order))  # of every edge across j


def _stage_memory(p: Prefix, j: int, ks: np.ndarray, counts: MemoryCounts) -> np.ndarray:
    """The bytes `counts` charge a replica of each stage [j, k), k in `ks` (a microbatch whose
    W is pending at all its activations: the runtime keeps nearly all, docs/memory.md), and
    its message buffers."""
    activations = p.activations[ks] - p.activations[j]
    return np.maximum(*counts.charges(
        p.weights[ks] - p.weights[j], p.grad[ks] - p.grad[j], p.params[ks] - p.params[j],
        activations, activations,
    )) + stage_bytes(p.edges[j], p.edges[ks])  # fmt: skip


def tie_positions(cost_graph: CostGraph, order: list[str]) -> list[list[int]]:
    """Per tie (a tensor with gradients that several nodes use), its users' positions in
    `order`, where they lie at more than one."""
    position = {n: i for i, n in enumerate(order)}
    node_of = {m: n for n, members in cost_graph.graph.nodes(data="members") for m in members}
    ties = []
    for tie in cost_graph.meta.get("ties", []):
        spots = sorted({position[node_of[m]] for m in tie["nodes"] if m in node_of})
        if len(spots) > 1:
            ties.append(spots)
    return ties


def split_ties(n: int, ties: list[list[int]]) -> np.ndarray:
    """`split[j, k]`: the stage of positions [j, k) holds some but not all users of a tie."""
    split = np.zeros((n + 1, n + 1), dtype=bool)
    for spots in ties:
        first, last = spots[0], spots[-1]
        for j in range(last + 1):
            if j <= first:  # holds the first user, not the last
                split[j, first + 1 : last + 1] = True
            else:  # holds a user, never the first
                split[j, next(p for p in spots if p >= j) + 1 :] = True
    return split


def _solve_general(
    p: Prefix,
    n: int,
    pricing: Pricing,
    split: np.ndarray | None = None,
    allowed: tuple[int, ...] | None = None,
) -> list[tuple[int, int, int]]:
    """Exact DP over (end, devices used, span level); returns (start, end, replicas) per stage.
    `split[j, k]`: a stage [j, k) may have one replica only; `allowed`: the replica counts a
    stage may have (None: any)."""
    cluster, rules, prices, microbatches = pricing
    total = cluster.num_devices
    levels = len(cluster.levels)
    bandwidth = np.array([lv.bandwidth for lv in cluster.levels])
    none = levels  # "no stage yet"
    best = np.full((n + 1, total + 1, levels + 1), np.inf)
    parent: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}
    best[0, 0, none] = 0.0
    speed = cluster.speed or (1.0,) * total
    memory = cluster.memory
    every = [0, *(prices.updates_every(rules, r, microbatches) for r in range(1, total + 1))]
    counts = {
        (m, r): rules.memory_bounds(total - m, r, microbatches, total)
        for m in range(total) for r in range(1, total - m + 1)
    } if memory is not None else {}  # fmt: skip
    for j in range(n):
        ks = np.arange(j + 1, n + 1)
        compute = p.compute[ks] - p.compute[j]
        grads = p.grad[ks] - p.grad[j]
        for m in range(total):
            for prev in range(levels + 1):
                value = best[j, m, prev]
                if not math.isfinite(value):
                    continue
                for r in range(1, total - m + 1):
                    if allowed and r not in allowed:
                        continue
                    span = cluster.level_of(m, m + r - 1)
                    comm = 0.0
                    if j > 0:
                        level = max(prev, cluster.level_of(m - 1, m), span)
                        comm = prices.transfer_s(p.cut[j], bandwidth[level], r)
                    allreduce = prices.allreduce_s(grads, r, bandwidth[span], every[r])
                    sigma = min(speed[m : m + r])
                    time = prices.stage_time(compute / sigma, r, comm, allreduce)
                    if memory is not None:
                        fits = _stage_memory(p, j, ks, counts[m, r]) <= memory
                        time = np.where(fits, time, np.inf)
                    if split is not None and r > 1:
                        time = np.where(split[j, ks], np.inf, time)
                    candidate = np.maximum(value, time)
                    target = best[ks, m + r, span]
                    better = candidate < target
                    if better.any():
                        best[ks[better], m + r, span] = candidate[better]
                        for k in ks[better]:
                            parent[(int(k), m + r, span)] = (j, m, prev, r)
    final = best[n, :, :levels]
    if not np.isfinite(final).any():
        raise PartitionError(_infeasible_message(p, n, cluster))
    value = final.min()
    m, span = (int(x) for x in np.argwhere(final == value)[0])  # fewest devices, then level
    stages = []
    k = n
    while k > 0:
        j, m_prev, prev, r = parent[(k, m, span)]
        stages.append((j, k, r))
        k, m, span = j, m_prev, prev
    return stages[::-1]


def _infeasible_message(p: Prefix, n: int, cluster: Cluster) -> str:
    need = float(p.weights[n] - p.weights[0])
    return (
        f"no placement fits: device memory is {cluster.memory:.4g} B, and the model's weights, "
        f"gradients and optimizer state alone take {need:.4g} B (plus activations per "
        f"microbatch in flight); use more devices, a larger memory, fewer microbatches in flight "
        "(schedule 1f1b), or a smaller microbatch. dynprog checks memory with a safe bound on the "
        "microbatches in flight; solver='cpsat' checks it exactly and may still find a plan"
    )


@register_solver("dynprog")
def dp(cost_graph: CostGraph, cluster: Cluster, options: dict[str, Any]) -> Plan:
    """Exact dynamic program over linear orders with replicas and device hierarchy (default)."""
    pricing = Pricing.of(cluster, options)
    _, rules, prices, microbatches = pricing
    unknown = set(options) - {*SEARCH, "orders", "cost_model"}
    if unknown:
        raise PartitionError(
            f"dynprog: unknown options {sorted(unknown)}; dynprog takes 'orders', 'cost_model'"
        )
    orders = linear_orders(cost_graph)
    chosen = options.get("orders") or list(orders)
    pace = ring_pace(prices, rules, cluster.num_devices, microbatches)
    allowed = options.get("replica_counts")
    plain = cluster.speed is None and cluster.memory is None
    flat = plain and cluster.is_flat
    fast = plain and pace is not None and not allowed
    best: Plan | None = None
    failure: PartitionError | None = None
    for name in chosen:
        if name not in orders:
            if name in ("graph", "dfs", "bfs", "critical_path"):
                continue  # the same order as one already tried
            raise PartitionError(
                f"dynprog: unknown order {name!r}; choose from graph, dfs, bfs, critical_path"
            )
        order = orders[name]
        p = Prefix(cost_graph, order)
        ties = [] if rules.replicates_ties else tie_positions(cost_graph, order)
        try:
            if flat and not ties and (cluster.num_devices <= REACH_DEVICES or not fast):
                cuts = solve_reach(p, len(order), cluster, prices, rules, microbatches, allowed)
            elif fast and not ties:
                cuts = solve_bisection(p, len(order), cluster, prices, pace)
            else:
                split = split_ties(len(order), ties) if ties else None
                cuts = _solve_general(p, len(order), pricing, split, allowed)
        except PartitionError as e:
            failure = e  # another order may fit
            continue
        groups = [(order[j:k], r) for j, k, r in cuts]
        candidate = make_plan(cost_graph, cluster, groups, options, "dynprog")
        candidate = candidate.with_(options={**candidate.options, "order": name})
        if best is None or candidate.predicted_time < best.predicted_time:
            best = candidate
    if best is None:
        raise failure
    return best
