"""`ideal`: exact partitioning of a DAG into convex stages with replicas, on pdcompile's cost model.

A plan with contiguous stages is a chain of ideals (downsets: node sets closed under
predecessors) {} = I_0 < I_1 < ... < I_S = all nodes; stage s is I_s minus I_{s-1}, which is
always convex, and its nodes are listed in the graph's order, which every edge respects. Unlike
`dynprog`, which cuts a few linear orders, this covers every contiguous plan of the DAG. Data
sources (kind "input", no predecessors) are kept in the first stage, as every pdcompile solver does.

The dynamic program runs over states (ideal I, devices used m) -> smallest bottleneck, and
prices stages with the cost model (`options["cost_model"]`) on a flat cluster (one bandwidth): a
stage J - I on ranks [m, m + r) takes compute(J - I) / (sigma r) + 2 cut(I) / bw / r +
allreduce / u by default, where cut(I) is the bytes of the tensors produced in I with a consumer
outside I (each producer once, at its largest out-edge). Sums over J - I are differences of
per-ideal sums. Ideals are processed by size, with numpy over every (sub-ideal, ideal) pair of a
size and every replica count: O(P D^2) for P comparable pairs and D devices.

Memory (when the cluster has a limit) is checked per stage with the schedule's `memory_bounds`
(as `dynprog` does, the W's a split schedule leaves pending included), so the plan fits under those
counts but one that fits may be missed.
Clusters with more than one level, graphs with more than `max_ideals` ideals, problems of more
than `max_transitions` DP transitions (P D (D + 1) / 2), and graphs with tied tensors under a
schedule that does not replicate ties (`pipedream`: a stage holding part of a tie needs one
replica, which this DP does not model) fall back to `dynprog`; `plan.options` then holds `fallback`
and `reason`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdcompile.core.cluster import Cluster
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError
from pdcompile.core.message_buffers import stage_bytes
from pdcompile.passes.planning.cost_model import Pricing
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.solver_kit import SEARCH, make_plan, register_solver
from pdcompile.passes.planning.solvers.dp import dp, tie_positions
from pdcompile.passes.planning.stage_sums import producer_bytes
from pdcompile.scheduling.base import MemoryCounts

MAX_IDEALS = 20_000
MAX_TRANSITIONS = 3_000_000_000  # about 15 s at ~0.2 G transitions/s
_CHUNK = 1 << 22  # (pair, device count) cells relaxed at once: bounds numpy temporaries


# per ideal: sums over its nodes, `cut`: bytes produced inside it and consumed outside (each
# tensor once), and `edges`: the bytes of every edge leaving it (a bound on its messages)
_SUMS = ("compute", "grad", "weights", "params", "activations", "cut", "edges")


@dataclass
class _Lattice:
    """The ideals that hold every data source (and the empty one), in order of size."""

    masks: list[int] = field(default_factory=list)  # node bitmask per ideal; 0 is the empty one
    below: list[int] = field(default_factory=list)  # bitset of the ideals strictly inside
    levels: list[list[int]] = field(default_factory=list)  # ideal indices by size
    sums: list[tuple] = field(default_factory=list)  # `_SUMS` per ideal
    pairs: int = 0

    def add(self, mask: int, sums: tuple) -> int:
        self.masks.append(mask)
        self.below.append(0)
        self.sums.append(sums)
        return len(self.masks) - 1

    def subsets(self, j: int) -> np.ndarray:
        """Indices of the ideals strictly inside ideal `j`."""
        raw = self.below[j].to_bytes((j + 8) // 8, "little")
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
        return np.flatnonzero(bits)


class _Graph:
    """Per-node costs of a CostGraph as bitmask-indexed lists."""

    def __init__(self, cost_graph: CostGraph) -> None:
        g = cost_graph.graph
        self.nodes = cost_graph.nodes
        index = {n: i for i, n in enumerate(self.nodes)}
        self.preds = [[index[p] for p in g.predecessors(n)] for n in self.nodes]
        self.pred_mask = [sum(1 << p for p in ps) for ps in self.preds]
        self.succ_mask = [sum(1 << index[s] for s in g.successors(n)) for n in self.nodes]
        self.out = [producer_bytes(cost_graph, n) for n in self.nodes]
        self.edges_out = [sum(b for _, _, b in g.out_edges(n, data="bytes")) for n in self.nodes]
        self.edges_in = [sum(b for _, _, b in g.in_edges(n, data="bytes")) for n in self.nodes]
        attrs = [g.nodes[n] for n in self.nodes]
        self.compute = cost_graph.compute_times()  # the loss at the output's node
        self.grad = [a["grad_bytes"] for a in attrs]
        self.weights = [a["param_bytes"] + a["grad_bytes"] + a["optimizer_bytes"] for a in attrs]
        self.params = [a["param_bytes"] for a in attrs]
        self.activations = [a["activation_bytes"] for a in attrs]
        self.sources = sum(
            1 << i for i, a in enumerate(attrs) if a["kind"] == "input" and not self.preds[i]
        )

    def sums(self, mask: int) -> tuple:
        members = [i for i in range(len(self.nodes)) if mask >> i & 1]
        cut = sum(self.out[i] for i in members if self.succ_mask[i] & ~mask)
        edges = sum(self.edges_out[i] for i in members) - sum(self.edges_in[i] for i in members)
        return (
            sum(self.compute[i] for i in members), sum(self.grad[i] for i in members),
            sum(self.weights[i] for i in members), sum(self.params[i] for i in members),
            sum(self.activations[i] for i in members), cut, edges,
        )  # fmt: skip

    def extend(self, sums: tuple, mask: int, v: int) -> tuple:
        """The sums of ideal `mask` plus node `v`, from those of `mask`."""
        new = mask | 1 << v
        cut = sums[5] + (self.out[v] if self.succ_mask[v] & ~new else 0)
        cut -= sum(self.out[u] for u in self.preds[v] if not self.succ_mask[u] & ~new)
        edges = sums[6] + self.edges_out[v] - self.edges_in[v]  # its predecessors are inside
        return (
            sums[0] + self.compute[v], sums[1] + self.grad[v], sums[2] + self.weights[v],
            sums[3] + self.params[v], sums[4] + self.activations[v], cut, edges,
        )  # fmt: skip


def _enumerate(cost_graph: CostGraph, limit: int) -> _Lattice | int:
    """The ideals holding every data source, plus the empty one; their count if over `limit`."""
    graph = _Graph(cost_graph)
    lattice = _Lattice()
    lattice.add(0, (0.0, 0, 0, 0, 0, 0, 0))
    lattice.levels.append([0])
    if graph.sources:
        j = lattice.add(graph.sources, graph.sums(graph.sources))
        lattice.below[j] = 1
        lattice.levels.append([j])
    n, count = len(graph.nodes), len(lattice.masks)
    while lattice.levels[-1] and lattice.masks[lattice.levels[-1][0]] != (1 << n) - 1:
        found: dict[int, int] = {}
        for i in lattice.levels[-1]:
            mask = lattice.masks[i]
            for v in range(n):
                if mask >> v & 1 or graph.pred_mask[v] & ~mask:
                    continue
                new = mask | 1 << v
                j = found.get(new)
                if j is None:
                    count += 1
                    if count > limit:
                        return count
                    j = found[new] = lattice.add(new, graph.extend(lattice.sums[i], mask, v))
                lattice.below[j] |= lattice.below[i] | 1 << i
        lattice.levels.append(list(found.values()))
    lattice.pairs = sum(b.bit_count() for b in lattice.below)
    return lattice


class _Model:
    """Stage times and memory of ideal differences on a flat cluster, vectorized over pairs."""

    def __init__(
        self,
        lattice: _Lattice,
        pricing: Pricing,
    ) -> None:
        cluster, rules, prices, microbatches = pricing
        self.lattice = lattice
        self.total = cluster.num_devices
        self.bandwidth = cluster.levels[0].bandwidth
        self.prices = prices
        self.every = [0, *(prices.updates_every(rules, r, microbatches)
                           for r in range(1, self.total + 1))]  # fmt: skip
        self.memory = cluster.memory
        self.allowed: tuple[int, ...] | None = None  # replica counts a stage may have (any)
        self.homogeneous = cluster.speed is None or len(set(cluster.speed)) == 1
        speed = cluster.speed or (1.0,) * self.total
        d = self.total
        self.speed = np.ones((d + 1, d + 1))  # [m, r]: the slowest of ranks m .. m + r - 1
        self.counts = np.zeros((5, d + 1, d + 1))  # `MemoryCounts` fields x [m, r]
        for m in range(d):
            for r in range(1, d - m + 1):
                self.speed[m, r] = min(speed[m : m + r])
                counts = rules.memory_bounds(d - m, r, microbatches, d)
                self.counts[:, m, r] = (*counts[:3], *counts.graded)
        self.arrays = dict(zip(_SUMS, np.array(lattice.sums, dtype=float).T, strict=True))

    def parts(self, pi: np.ndarray, pj: np.ndarray) -> dict[str, np.ndarray]:
        a = self.arrays
        diff = {name: a[name][pj] - a[name][pi] for name in _SUMS[:-2]}
        diff["cut"], diff["into"], diff["out"] = a["cut"][pi], a["edges"][pi], a["edges"][pj]
        return diff

    def time(self, parts: dict[str, np.ndarray], r: int, ms: np.ndarray) -> np.ndarray:
        """Stage times (pairs x first ranks `ms`), inf where the safe memory bound is exceeded
        or `r` replicas are not allowed."""
        prices = self.prices
        if self.allowed and r not in self.allowed:
            return np.full((len(parts["cut"]), len(ms)), np.inf)
        comm = prices.transfer_s(parts["cut"], self.bandwidth, r)[:, None]
        allreduce = prices.allreduce_s(parts["grad"], r, self.bandwidth, self.every[r])[:, None]
        speed = self.speed[0, r] if self.homogeneous else self.speed[ms, r][None, :]
        time = prices.stage_time(parts["compute"][:, None] / speed, r, comm, allreduce)
        if self.memory is not None:  # a pending W at all its activations, as dynprog
            counts = MemoryCounts(*self.counts[:, ms, r][:, None, :])
            acts = parts["activations"][:, None]
            memory = np.maximum(*counts.charges(
                parts["weights"][:, None], parts["grad"][:, None], parts["params"][:, None],
                acts, acts,
            )) + stage_bytes(parts["into"], parts["out"])[:, None]  # fmt: skip
            time = np.where(memory <= self.memory, time, np.inf)
        return time


def _solve(model: _Model) -> list[tuple[int, int, int]]:
    """Exact DP; returns (inner ideal, outer ideal, replicas) per stage."""
    lattice, d = model.lattice, model.total
    best = np.full((len(lattice.masks), d + 1), np.inf)
    best[0, 0] = 0.0
    for level in lattice.levels[1:]:
        chunk: list[tuple[int, np.ndarray]] = []
        size = 0
        for j in level:
            subs = lattice.subsets(j)
            chunk.append((j, subs))
            size += len(subs)
            if size * (d + 1) >= _CHUNK:
                _relax(model, best, chunk)
                chunk, size = [], 0
        if chunk:
            _relax(model, best, chunk)
    full = len(lattice.masks) - 1
    if not np.isfinite(best[full]).any():
        raise PartitionError(_infeasible(model))
    m = int(np.argmin(best[full]))  # fewest devices among the best
    stages, j = [], full
    while j:
        i, r = _parent(model, best, j, m)
        stages.append((i, j, r))
        j, m = i, m - r
    return stages[::-1]


def _relax(model: _Model, best: np.ndarray, chunk: list[tuple[int, np.ndarray]]) -> None:
    """best[j, m + r] <- min over inner ideals i and m of max(best[i, m], time(i, j, m, r))."""
    js = np.array([j for j, _ in chunk])
    counts = np.array([len(s) for _, s in chunk])
    pi = np.concatenate([s for _, s in chunk])
    pj = np.repeat(js, counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    parts = model.parts(pi, pj)
    before = best[pi]
    d = model.total
    for r in range(1, d + 1):
        ms = np.arange(d - r + 1)
        reach = before[:, : d - r + 1]
        if not np.isfinite(reach).any():
            continue
        candidate = np.maximum(reach, model.time(parts, r, ms))
        values = np.minimum.reduceat(candidate, starts, axis=0)
        best[js, r:] = np.minimum(best[js, r:], values)


def _parent(model: _Model, best: np.ndarray, j: int, m_after: int) -> tuple[int, int]:
    """The (inner ideal, replicas) that gave best[j, m_after]."""
    subs = model.lattice.subsets(j)
    parts = model.parts(subs, np.full(len(subs), j))
    choice, value = (0, 0), np.inf
    for r in range(1, m_after + 1):
        m = m_after - r
        candidate = np.maximum(best[subs, m], model.time(parts, r, np.array([m]))[:, 0])
        k = int(np.argmin(candidate))
        if candidate[k] < value:
            choice, value = (int(subs[k]), r), candidate[k]
    return choice


def _infeasible(model: _Model) -> str:
    lattice = model.lattice
    return (
        f"no placement fits: device memory is {model.memory:.4g} B, and the model's weights, "
        f"gradients and optimizer state alone take {lattice.sums[-1][2]:.4g} B (plus "
        "activations per microbatch in flight); use more devices, a larger memory, fewer "
        "microbatches in flight (schedule 1f1b), or a smaller microbatch"
    )


def _fallback(cost_graph: CostGraph, cluster: Cluster, options: dict[str, Any], why: str) -> Plan:
    base = {k: options[k] for k in (*SEARCH, "cost_model") if k in options}
    plan = dp(cost_graph, cluster, base)
    own = {k: v for k, v in options.items() if k not in base}
    return plan.with_(
        solver="ideal", options={**own, **plan.options, "fallback": "dynprog", "reason": why}
    )


@register_solver("ideal")
def ideal(cost_graph: CostGraph, cluster: Cluster, options: dict[str, Any]) -> Plan:
    """Exact DP over the DAG's ideals (every convex-stage plan) with replicas; flat clusters."""
    own = ("max_ideals", "max_transitions", "cost_model")
    unknown = set(options) - {*SEARCH, *own}
    if unknown:
        raise PartitionError(
            f"ideal: unknown options {sorted(unknown)}; ideal takes {', '.join(map(repr, own))}"
        )
    pricing = Pricing.of(cluster, options)
    rules = pricing.rules
    limit = int(options.get("max_ideals", MAX_IDEALS))
    max_work = int(options.get("max_transitions", MAX_TRANSITIONS))
    if not cluster.is_flat:
        why = (
            f"ideal: the cluster has {len(cluster.levels)} levels and ideal handles flat "
            "clusters only; used dynprog"
        )
        return _fallback(cost_graph, cluster, options, why)
    if not rules.replicates_ties and tie_positions(cost_graph, cost_graph.nodes):
        why = (
            f"ideal: under {rules.name}, stages holding part of a tied tensor need one replica, "
            "which ideal's DP does not model; used dynprog"
        )
        return _fallback(cost_graph, cluster, options, why)
    lattice = _enumerate(cost_graph, limit)
    if isinstance(lattice, int):
        why = f"ideal: the graph has more ideals than max_ideals={limit}; used dynprog"
        return _fallback(cost_graph, cluster, options, why)
    d = cluster.num_devices
    work = lattice.pairs * d * (d + 1) // 2
    if work > max_work:
        why = (
            f"ideal: {len(lattice.masks)} ideals, {lattice.pairs} nested pairs x {d} devices "
            f"make {work:.3g} DP transitions > max_transitions={max_work:.3g}; used dynprog"
        )
        return _fallback(cost_graph, cluster, options, why)
    model = _Model(lattice, pricing)
    model.allowed = options.get("replica_counts")
    nodes = cost_graph.nodes
    groups = []
    for i, j, r in _solve(model):
        stage = lattice.masks[j] & ~lattice.masks[i]
        groups.append(([n for k, n in enumerate(nodes) if stage >> k & 1], r))
    result = make_plan(cost_graph, cluster, groups, options, "ideal")
    return result.with_(options={**result.options, "ideals": len(lattice.masks)})
