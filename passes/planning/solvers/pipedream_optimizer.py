"""PipeDream's hierarchical partitioning optimizer, re-implemented faithfully and vectorised.

PipeDream (SOSP 2019, msr-fiddle/pipedream `optimizer/optimizer_graph_hierarchical.py` with
`graph/graph.py`) cuts a layer DAG into pipeline stages with replica counts, level by level over a
device hierarchy, with a dynamic program over the "antichain" states of the DAG. This module
reproduces its state construction, state order, cost model, options and printed stage tables
(quirks included: see docs/pipedream_solver.md); the dynamic program runs with numpy over all stage
ends, start states and split points at once instead of in Python loops.

Pure and torch-free: a CostGraph and options in, a `PipeDreamResult` out.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError
from pdcompile.core.pipedream_format import file_order

__all__ = ["PipeDreamResult", "optimize_pipedream"]

Row = tuple[int, int, float, int]
# elements of one (start rows x split points x stage ends) block of the dynamic program
_BLOCK = 1 << 21


@dataclass(frozen=True)
class PipeDreamResult:
    """What PipeDream's optimizer computes and prints, and the flat partition it implies.

    `time_per_stage`: its "Time per stage in pipeline" (seconds per minibatch, the predicted
    bottleneck). `single_machine_time`: total compute of the graph. `data_parallel_time`: its
    estimate for pure data parallelism over all devices; `speedup_vs_dp` = that / time_per_stage.
    `num_states`: antichain states. `levels`: its printed stage tables in print order (the top
    level first, then one table per stage of the level above), rows (start state, end state,
    compute seconds, replicas at that level). `stages`: the final flat stages in pipeline order,
    (node ids, devices = product of the replica counts along the hierarchy); every node of the
    CostGraph is in exactly one stage.
    """

    time_per_stage: float
    single_machine_time: float
    data_parallel_time: float
    speedup_vs_dp: float
    num_states: int
    levels: tuple[tuple[Row, ...], ...]
    stages: tuple[tuple[tuple[str, ...], int], ...]


@dataclass(frozen=True)
class _States:
    """The antichain states in PipeDream's order, with the sums its optimizer reads."""

    names: list[str]  # layers PipeDream keeps, in its dict order
    closure: list[int]  # per state: bitmask over `names` of the layers at or before it
    pred: np.ndarray  # (N, N) bool: pred[j, k] = state k precedes state j in the antichain DAG
    compute: np.ndarray  # (N,) seconds of the layers in each state's closure
    activation: np.ndarray  # (N,) bytes
    parameter: np.ndarray  # (N,) bytes
    output: np.ndarray  # (N,) bytes of the state's augmented antichain (what crosses the cut)
    removed_inputs: list[str]  # `Input` sources, zeroed and placed in the first stage


@dataclass
class _Level:
    """One level's table A[i][j][m] of PipeDream's DP as arrays (inf stands for None).

    Rows are start rows i (N+1 of them; the final level keeps only row 0), columns end states j,
    m is the machine index (m + 1 machines)."""

    time: np.ndarray  # seconds per minibatch of the best plan
    split: np.ndarray  # its last split state k, -1 for none (one stage)
    split_m: np.ndarray  # machine index m - m' of the part before the split
    replicas: np.ndarray  # replicas of its last stage

    @classmethod
    def empty(cls, shape: tuple[int, int, int]) -> _Level:
        """A table of `shape` (rows, ends, machines) with every entry None."""
        return cls(
            time=np.full(shape, np.inf),
            split=np.full(shape, -1, dtype=np.int32),
            split_m=np.full(shape, -1, dtype=np.int32),
            replicas=np.zeros(shape, dtype=np.int32),
        )


# -- states ------------------------------------------------------------------------------


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _bit_matrix(masks: list[int], width: int) -> np.ndarray:
    """Row i: the bits of masks[i] as booleans, bit 0 first, `width` columns."""
    size = max((width + 7) // 8, 1)
    raw = b"".join(mask.to_bytes(size, "little") for mask in masks)
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(len(masks), size)
    return np.unpackbits(rows, axis=1, bitorder="little")[:, :width].astype(bool)


def _build_states(cost_graph: CostGraph) -> _States:
    """PipeDream's input/sink removal, antichain DAG, state order and per-state sums."""
    layers = _Layers.of(cost_graph)
    augmented_of, adjacency = _Antichains(layers).dag()
    states = _topological_order(adjacency)
    return _state_sums(cost_graph, layers, states, augmented_of, _precedence(states, adjacency))


@dataclass(frozen=True)
class _Layers:
    """The layers PipeDream keeps (input sources and `__getitem__` sinks set aside), indexed in
    its dict order, with their edges and transitive closures as bitmasks over those indices."""

    names: list[str]  # in PipeDream's dict order
    removed_inputs: list[str]  # `Input` sources
    out: list[list[int]]  # per layer: its successors, in edge order
    ins: list[list[int]]  # per layer: its predecessors, in edge order
    preds: list[int]  # per layer: bitmask of every layer before it
    succs: list[int]  # per layer: bitmask of every layer after it
    out_mask: list[int]  # per layer: bitmask of its successors

    @classmethod
    def of(cls, cost_graph: CostGraph) -> _Layers:
        """The kept layers of `cost_graph`, in a PipeDream file's order.

        Raises:
            PartitionError: no layer is left.
        """
        g = cost_graph.graph
        order, edges = file_order(cost_graph)
        inputs = [n for n in order if g.nodes[n]["kind"] == "input" and g.in_degree(n) == 0]
        left = set(order) - set(inputs)
        has_out = {u for u, v in edges if u in left and v in left}
        getitem = [
            n
            for n in order
            if n in left
            and n not in has_out
            and g.nodes[n]["description"].startswith("__getitem__")
        ]
        left -= set(getitem)
        names = [n for n in order if n in left]
        if not names:
            raise PartitionError(
                f"the CostGraph has {len(g)} nodes but none is left once its input sources and "
                "__getitem__ sinks are set aside; PipeDream's optimizer needs at least one layer"
            )
        index = {n: i for i, n in enumerate(names)}
        out: list[list[int]] = [[] for _ in names]
        ins: list[list[int]] = [[] for _ in names]
        for u, v in edges:
            if u in index and v in index:
                out[index[u]].append(index[v])
                ins[index[v]].append(index[u])
        topo = [index[n] for n in cost_graph.nodes if n in index]
        preds = [0] * len(names)
        for v in topo:
            for u in ins[v]:
                preds[v] |= preds[u] | (1 << u)
        succs = [0] * len(names)
        for u in reversed(topo):
            for v in out[u]:
                succs[u] |= succs[v] | (1 << v)
        out_mask = [sum(1 << v for v in set(vs)) for vs in out]
        return cls(names, inputs, out, ins, preds, succs, out_mask)


class _Antichains:
    """PipeDream's antichain DAG of the layers: its (de)augmentation of antichains, memoised,
    and the breadth-first construction from the first source."""

    def __init__(self, layers: _Layers) -> None:
        self.layers = layers
        self._augmented: dict[tuple[int, ...], list[int]] = {}
        self._deaugmented: dict[tuple[int, ...], list[int]] = {}
        self._needed: dict[int, int] = {}

    def needed(self, a: int) -> int:
        """a's predecessors with an output outside a and its predecessors (a bitmask)."""
        cache = self._needed
        if a not in cache:
            preds = self.layers.preds
            inside = preds[a] | (1 << a)
            out_mask = self.layers.out_mask
            cache[a] = sum(1 << p for p in _bits(preds[a]) if out_mask[p] & ~inside)
        return cache[a]

    def augment(self, antichain: list[int]) -> list[int]:
        """The antichain plus the predecessors whose outputs are still needed after the cut."""
        key = tuple(sorted(antichain))
        cache = self._augmented
        if key not in cache:
            extra = 0
            for a in antichain:
                extra |= self.needed(a)
            # PipeDream lists `extra` in the order of a set of strings (PYTHONHASHSEED-dependent
            # when it has two or more); file order here (_bits is ascending)
            cache[key] = _bits(extra) + antichain
        return cache[key]

    def deaugment(self, augmented: list[int]) -> list[int]:
        """The members of `augmented` with no successor among them, in its order."""
        key = tuple(sorted(augmented))
        cache = self._deaugmented
        if key not in cache:
            succs = self.layers.succs
            members = sum(1 << x for x in set(augmented))
            antichain: list[int] = []
            for x in augmented:
                if not succs[x] & members and x not in antichain:
                    antichain.append(x)
            cache[key] = antichain
        return cache[key]

    def next_antichains(self, antichain: list[int]) -> list[list[int]]:
        """The antichains one layer past `antichain`, in PipeDream's order."""
        out, succs = self.layers.out, self.layers.succs
        augmented = self.augment(antichain)
        members = sum(1 << x for x in set(augmented))
        found = []
        for x in augmented:
            for nxt in out[x]:
                if nxt in antichain or succs[nxt] & members:
                    continue
                found.append(self.deaugment([nxt if y == x else y for y in augmented]))
        return found

    def dag(self) -> tuple[list[list[int]], list[list[int]]]:
        """Breadth-first from the first source, as PipeDream builds it: per state (in creation
        order) its augmented antichain, and its out-edges in insertion order."""
        ins = self.layers.ins
        sources = [i for i in range(len(ins)) if not ins[i]]
        start = [sources[0]]
        ids = {tuple(sorted(start)): 0}
        augmented_of = [self.augment(start)]
        adjacency: list[list[int]] = [[]]
        expanded: set[tuple[int, ...]] = set()
        queue = deque([start])
        while queue:
            antichain = queue.popleft()
            key = tuple(sorted(antichain))
            if key in expanded:
                continue
            expanded.add(key)
            for nxt in self.next_antichains(antichain):
                nxt_key = tuple(sorted(nxt))
                if nxt_key not in ids:
                    ids[nxt_key] = len(augmented_of)
                    augmented_of.append(self.augment(nxt))
                    adjacency.append([])
                adjacency[ids[key]].append(ids[nxt_key])
                queue.append(nxt)
        return augmented_of, adjacency


def _topological_order(adjacency: list[list[int]]) -> list[int]:
    """PipeDream's topological sort of the states: depth-first from each node in creation
    order, out-edges in insertion order, reverse post-order (a one-layer graph keeps its single
    state, where PipeDream's state DAG would be empty)."""
    post: list[int] = []
    seen = [False] * len(adjacency)
    for root in range(len(adjacency)):
        if seen[root]:
            continue
        seen[root] = True
        stack = [(root, 0)]
        while stack:
            node, pos = stack.pop()
            if pos < len(adjacency[node]):
                stack.append((node, pos + 1))
                child = adjacency[node][pos]
                if not seen[child]:
                    seen[child] = True
                    stack.append((child, 0))
            else:
                post.append(node)
    return post[::-1]


def _precedence(states: list[int], adjacency: list[list[int]]) -> np.ndarray:
    """(N, N) bool: [j, k] = the k-th state in `states` precedes the j-th in the DAG."""
    position = {s: i for i, s in enumerate(states)}
    ancestors = [0] * len(states)
    for s in states:
        for t in adjacency[s]:
            ancestors[position[t]] |= ancestors[position[s]] | (1 << position[s])
    return _bit_matrix(ancestors, len(states))


def _state_sums(
    cost_graph: CostGraph,
    layers: _Layers,
    states: list[int],
    augmented_of: list[list[int]],
    pred: np.ndarray,
) -> _States:
    """The states in `states`' order with the sums of compute, activation and parameter bytes
    over each one's closure, and the output bytes of its augmented antichain."""
    g, names, preds = cost_graph.graph, layers.names, layers.preds
    attrs = [g.nodes[name] for name in names]
    closure = []
    for s in states:
        mask = 0
        for x in augmented_of[s]:
            mask |= preds[x] | (1 << x)
        closure.append(mask)
    members = [np.flatnonzero(row) for row in _bit_matrix(closure, len(names))]

    def sums(values: list[float]) -> np.ndarray:
        column = np.array(values, dtype=float)
        return np.array([math.fsum(column[m].tolist()) for m in members], dtype=float)

    output = [a["output_bytes"] for a in attrs]
    return _States(
        names=names,
        closure=closure,
        pred=pred,
        compute=sums([a["forward_s"] + a["backward_s"] for a in attrs]),
        activation=sums([a["activation_bytes"] for a in attrs]),
        parameter=sums([a["param_bytes"] for a in attrs]),
        output=np.array([math.fsum(output[x] for x in augmented_of[s]) for s in states]),
        removed_inputs=layers.removed_inputs,
    )


# -- the dynamic program -----------------------------------------------------------------


def _blocks(per_state: np.ndarray) -> np.ndarray:
    """(N+1, N): row 0 the prefix values, row i >= 1 the value of states i-1 (excl.) .. j.

    Entries with j < i are NaN (PipeDream's None)."""
    n = len(per_state)
    out = np.full((n + 1, n), np.nan)
    out[0] = per_state
    rows, cols = np.triu_indices(n, 1)
    out[rows + 1, cols] = per_state[cols] - per_state[rows]
    return out


@dataclass(frozen=True)
class _Options:
    straight_pipeline: bool
    use_memory_constraint: bool
    memory_size: float
    use_fewer_machines: bool
    activation_compression_ratio: float | None


def _min_max(prev: np.ndarray, stage_t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """min over k of max(prev[i, k], stage_t[j, k]) and its first argmin k, for every (i, j).

    prev[i, k] is inf for k < i and stage_t[j, k] for k >= j, so a block of rows [a, b) and ends
    [c, d) only looks at k in [a, d - 1)."""
    rows, n = prev.shape
    best = np.full((rows, n), np.inf)
    arg = np.full((rows, n), -1, dtype=np.int64)
    width = 64
    step = max(1, _BLOCK // (width * n))
    for a in range(0, min(rows, n - 1), step):
        b = min(rows, a + step)
        for c in range(a + 1, n, width):
            d = min(n, c + width)
            cand = np.maximum(prev[a:b, None, a : d - 1], stage_t[None, c:d, a : d - 1])
            k = cand.argmin(axis=2)
            best[a:b, c:d] = np.take_along_axis(cand, k[:, :, None], axis=2)[:, :, 0]
            arg[a:b, c:d] = k + a
    return best, arg


@dataclass(frozen=True)
class _StateBlocks:
    """What every level's DP reads besides its compute: the (N+1, N) block values of activation
    and parameter bytes (`_blocks`), each state's output bytes and the precedence matrix."""

    activation: np.ndarray
    parameter: np.ndarray
    output: np.ndarray
    pred: np.ndarray

    @classmethod
    def of(cls, states: _States) -> _StateBlocks:
        return cls(_blocks(states.activation), _blocks(states.parameter), states.output,
                   states.pred)  # fmt: skip


@dataclass(frozen=True)
class _LevelSpec:
    """One level of the hierarchy: its machines, the machines of the level below (PipeDream
    divides the first stage's all-reduce by them), its bandwidth (bytes/s) and whether it is
    the outermost (final) level."""

    num_machines: int
    machines_within: int
    bandwidth: float
    final_level: bool


def _solve_level(
    compute: np.ndarray, blocks: _StateBlocks, spec: _LevelSpec, opts: _Options
) -> _Level:
    """PipeDream's `compute_partitioning` for one level, vectorised over (i, j, k).

    `compute`: (N+1, N) block values (`_blocks`; NaN or inf for None), as `blocks`' arrays.
    The final level only fills row 0 (a block starting at the first state), as PipeDream does.
    """
    # The three loops stay in one function on purpose: their temporaries live until it returns.
    # In helpers they are freed between loops and the allocator returns memory to the OS and
    # faults it in again (the last-stage search in a helper: 2.2x the page faults, 16% slower
    # on resnet50 A_16flat_mem16G; the first two loops in helpers: 0-8% slower on its 2-level
    # runs, from run to run).
    n, num_machines, bandwidth = compute.shape[1], spec.num_machines, spec.bandwidth
    cmp = np.where(np.isnan(compute), np.inf, compute)
    known = ~np.isnan(blocks.activation)
    par = np.where(known, blocks.parameter, 0.0)
    memory = np.where(known, blocks.activation, 0.0) + par
    top = 1 if spec.final_level else n + 1
    level = _Level.empty((top, n, num_machines))

    # A[i][j][m] starts as one stage on m + 1 replicas: data parallelism over the block
    for m in range(1 if opts.straight_pipeline else num_machines):
        allreduce = (4 * m * par[:top]) / (bandwidth * (m + 1)) / spec.machines_within
        time = (cmp[:top] + allreduce) / (m + 1)
        if opts.use_memory_constraint:
            stash = math.ceil((num_machines - (m + 1)) / (m + 1)) * memory[:top]
            time = np.where(stash > opts.memory_size, np.inf, time)
        level.time[:, :, m] = time
        level.replicas[:, :, m] = m + 1

    # the last stage, states k+1 .. j on m' replicas, as [j, k]; inf where k does not precede j
    last = {}
    ratio = opts.activation_compression_ratio
    for mp in range(1, 2 if opts.straight_pipeline else num_machines):
        t = (cmp[1:] + (4 * (mp - 1) * par[1:]) / (bandwidth * mp)) / mp
        if ratio is not None:
            sent = (2.0 * blocks.output) / (bandwidth * mp) / ratio
            received = sent.copy()
            received[-1] = -np.inf  # the last state sends nothing on
            t = np.maximum(np.maximum(t, sent[:, None]), received[None, :])
        last[mp] = np.where(blocks.pred, t.T, np.inf)

    later = np.arange(n)[None, :] > np.arange(top)[:, None]  # j > i: the entries the DP updates
    for m in range(1, num_machines):
        current = [a[:, :, m] for a in (level.time, level.split, level.split_m, level.replicas)]
        if opts.use_fewer_machines:
            _take_fewer(level, m, later)
        best = np.full((top, n), np.inf)
        best_k = np.full((top, n), n, dtype=np.int64)
        best_mp = np.zeros((top, n), dtype=np.int64)
        for mp in range(1, 2 if opts.straight_pipeline else m + 1):
            stage = last[mp]
            if opts.use_memory_constraint:
                stash = memory[1:].T * math.ceil((num_machines - (m + 1)) / mp)
                stage = np.where(stash > opts.memory_size, np.inf, stage)
            value, arg = _min_max(level.time[:, :, m - mp], stage)
            # PipeDream scans k, then m' upwards, and keeps the first strict minimum
            take = (value < best) | ((value == best) & (arg < best_k))
            best = np.where(take, value, best)
            best_k = np.where(take, arg, best_k)
            best_mp = np.where(take, mp, best_mp)
        win = (best < current[0]) & later
        current[0][win] = best[win]
        current[1][win] = best_k[win]
        current[2][win] = m - best_mp[win]
        current[3][win] = best_mp[win]
    return level


def _take_fewer(level: _Level, m: int, later: np.ndarray) -> None:
    """`use_fewer_machines`: A[i][j][m] becomes A[i][j][m-1] where that is better (or A[i][j][m]
    is None), as PipeDream takes it; an infeasible A[i][j][m-1] never counts as better (Python 3
    PipeDream raises there)."""
    tables = (level.time, level.split, level.split_m, level.replicas)
    t = level.time[:, :, m]
    fewer = (np.isinf(t) | (level.time[:, :, m - 1] < t)) & later
    for table in tables:
        now = table[:, :, m]
        now[fewer] = table[:, :, m - 1][fewer]


# -- reading the tables ------------------------------------------------------------------


def _analyze(level: _Level, compute: np.ndarray, start: int, end: int, machines: int) -> list[Row]:
    """PipeDream's `analyze_partitioning`: the stage table of block (start, end) at one level."""
    j, m = end - 1, machines - 1
    splits, replicas = [], []
    while level.split[start, j, m] >= 0:
        k = int(level.split[start, j, m])
        splits.append(k + 1)
        replicas.append(int(level.replicas[start, j, m]))
        j, m = k, int(level.split_m[start, j, m])
    replicas.append(int(level.replicas[start, j, m]))
    bounds = [start, *reversed(splits), end]
    replicas.reverse()
    rows = []
    for (a, b), r in zip(pairwise(bounds), replicas, strict=True):
        time = compute[b - 1] - compute[a - 1] if a > 0 else compute[b - 1]
        rows.append((a, b, float(time), r))
    return rows


def _options(
    straight_pipeline: bool = False,
    use_memory_constraint: bool = False,
    memory_size: float = 16e9,
    use_fewer_machines: bool = False,
    activation_compression_ratio: float | None = None,
) -> _Options:
    """The options, checked (defaults as PipeDream's command line)."""

    def number(name: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise PartitionError(f"{name} must be a number, got {value!r}")
        return float(value)

    memory = number("memory_size", memory_size)
    if not memory > 0:
        raise PartitionError(
            f"memory_size must be > 0 bytes per device, got {memory_size!r} (PipeDream's default "
            "is 16e9)"
        )
    ratio = activation_compression_ratio
    if ratio is not None:
        ratio = number("activation_compression_ratio", ratio)
        if not (math.isfinite(ratio) and ratio > 0):
            raise PartitionError(
                "activation_compression_ratio must be None (inter-stage communication ignored) "
                f"or a finite number > 0 (1.0: uncompressed), got {activation_compression_ratio!r}"
            )
    return _Options(
        straight_pipeline=bool(straight_pipeline),
        use_memory_constraint=bool(use_memory_constraint),
        memory_size=memory,
        use_fewer_machines=bool(use_fewer_machines),
        activation_compression_ratio=ratio,
    )


def _hierarchy(
    num_machines: Sequence[int], bandwidths: Sequence[float]
) -> tuple[list[int], list[float]]:
    machines = list(num_machines)
    if not machines or not all(
        isinstance(m, (int, np.integer)) and not isinstance(m, bool) and m >= 1 for m in machines
    ):
        raise PartitionError(
            "num_machines must be a non-empty list of integers >= 1 (machines per level, "
            f"innermost first, e.g. [4, 4] for 4 servers of 4 GPUs), got {num_machines!r}"
        )
    links = list(bandwidths)
    if len(links) != len(machines):
        raise PartitionError(
            f"bandwidths has {len(links)} entries but num_machines has {len(machines)} levels "
            f"({machines}); give one bandwidth in bytes/s per level, innermost first"
        )
    if not all(
        isinstance(b, (int, float, np.number)) and not isinstance(b, bool) and b > 0 for b in links
    ):
        raise PartitionError(f"bandwidths must be numbers > 0 (bytes/s), got {bandwidths!r}")
    return [int(m) for m in machines], [float(b) for b in links]


def _infeasible(states: _States, machines: list[int], opts: _Options) -> PartitionError:
    hints = []
    if opts.straight_pipeline and not opts.use_fewer_machines:
        hints.append(
            "a straight pipeline gives every machine a stage of its own, so each level needs at "
            "least as many states as machines: pass use_fewer_machines=True or fewer machines"
        )
    if opts.use_memory_constraint:
        hints.append(
            f"the memory constraint allows {opts.memory_size:.4g} bytes per device, and a stage "
            "stashes its activations and parameters once per microbatch in flight after it "
            f"(the whole model: {states.activation[-1]:.4g} + {states.parameter[-1]:.4g} bytes): "
            "raise memory_size, add machines or drop use_memory_constraint"
        )
    return PartitionError(
        f"PipeDream's optimizer finds no feasible partition of {len(states.compute)} antichain "
        f"states over machines {machines} (straight_pipeline={opts.straight_pipeline}, "
        f"use_memory_constraint={opts.use_memory_constraint}, "
        f"use_fewer_machines={opts.use_fewer_machines}); " + "; ".join(hints or ["no stage fits"])
    )


def _solve(
    cost_graph: CostGraph, machines: list[int], links: list[float], opts: _Options
) -> tuple[_States, list[_Level]]:
    """States and the DP table of every level, innermost first."""
    states = _build_states(cost_graph)
    compute = _blocks(states.compute)
    blocks = _StateBlocks.of(states)
    levels: list[_Level] = []
    within = 1  # PipeDream divides the first stage's all-reduce by the level below's machines
    for depth, (m, bandwidth) in enumerate(zip(machines, links, strict=True)):
        spec = _LevelSpec(m, within, bandwidth, final_level=depth == len(machines) - 1)
        level = _solve_level(compute, blocks, spec, opts)
        levels.append(level)
        within = m
        compute = level.time[:, :, -1]  # the next level's compute: this level's best time
    return states, levels


def _flat_stages(
    cost_graph: CostGraph, states: _States, ranges: list[tuple[int, int, int]]
) -> tuple[tuple[tuple[str, ...], int], ...]:
    """Node ids per final stage: the layers in its end state's closure not in an earlier stage.

    `Input` sources join the first stage (as PipeDream places them); nodes no state covers
    (dropped `__getitem__` sinks) join the latest stage of their predecessors."""
    stage_of: dict[str, int] = {}
    taken = 0
    for s, (_, end, _) in enumerate(ranges):
        mask = states.closure[end - 1] & ~taken
        taken |= mask
        for x in _bits(mask):
            stage_of[states.names[x]] = s
    for name in states.removed_inputs:
        stage_of[name] = 0
    g = cost_graph.graph
    for name in cost_graph.nodes:
        if name not in stage_of:
            stage_of[name] = max((stage_of[p] for p in g.predecessors(name)), default=0)
    members: list[list[str]] = [[] for _ in ranges]
    for name in cost_graph.nodes:
        members[stage_of[name]].append(name)
    return tuple((tuple(m), devices) for m, (_, _, devices) in zip(members, ranges, strict=True))


def optimize_pipedream(
    cost_graph: CostGraph,
    num_machines: Sequence[int],
    bandwidths: Sequence[float],
    *,
    straight_pipeline: bool = False,
    use_memory_constraint: bool = False,
    memory_size: float = 16e9,
    use_fewer_machines: bool = False,
    activation_compression_ratio: float | None = None,
) -> PipeDreamResult:
    """Run PipeDream's hierarchical optimizer (`optimizer_graph_hierarchical.py`) on a CostGraph.

    Args:
        cost_graph: the layers: `forward_s + backward_s` is a layer's compute,
            `activation_bytes` what it stashes, `output_bytes` what it sends, `param_bytes` its
            weights. Sources of kind "input" are set aside and `__getitem__` sinks dropped, as
            PipeDream does; the node and edge order of a PipeDream file (`meta["pipedream"]`)
            fixes the state order.
        num_machines: machines per level, innermost first (PipeDream's `-n`).
        bandwidths: bytes/s between the machines of each level (`-b`).
        straight_pipeline: one replica per stage (`--straight_pipeline`).
        use_memory_constraint: enforce `memory_size` (`--use_memory_constraint`).
        memory_size: bytes per device (`-s`).
        use_fewer_machines: a block may leave machines unused (`--use_fewer_machines`).
        activation_compression_ratio: None ignores inter-stage communication, as PipeDream does
            without `--activation_compression_ratio`; a ratio divides the bytes sent.

    Returns:
        the predicted time per stage, the printed stage tables and the flat stages.

    Raises:
        PartitionError: a bad option value, a graph with no layer, or no feasible partition.

    Example:
        >>> g = CostGraph()
        >>> g.add_node("a", forward_s=0.25, backward_s=0.5, param_bytes=10**8, output_bytes=10**6)
        >>> g.add_node("b", forward_s=0.25, backward_s=0.5, param_bytes=10**8)
        >>> g.add_edge("a", "b", 10**6)
        >>> r = optimize_pipedream(g, [2], [1e9], activation_compression_ratio=1.0)
        >>> r.time_per_stage, r.levels, r.stages
        (0.75, (((0, 1, 0.75, 1), (1, 2, 0.75, 1)),), ((('a',), 1), (('b',), 1)))
    """
    opts = _options(
        straight_pipeline,
        use_memory_constraint,
        memory_size,
        use_fewer_machines,
        activation_compression_ratio,
    )
    machines, links = _hierarchy(num_machines, bandwidths)
    states, levels = _solve(cost_graph, machines, links, opts)
    n = len(states.compute)
    time_per_stage = float(levels[-1].time[0, n - 1, machines[-1] - 1])
    if not math.isfinite(time_per_stage):
        raise _infeasible(states, machines, opts)

    tables, ranges = _tables(states, levels, machines)
    data_parallel = _data_parallel_time(states, machines, links)
    return PipeDreamResult(
        time_per_stage=time_per_stage,
        single_machine_time=float(states.compute[-1]),
        data_parallel_time=data_parallel,
        speedup_vs_dp=data_parallel / time_per_stage,
        num_states=n,
        levels=tables,
        stages=_flat_stages(cost_graph, states, ranges),
    )


def _tables(
    states: _States, levels: Sequence[_Level], machines: Sequence[int]
) -> tuple[tuple[tuple[Row, ...], ...], list[tuple[int, int, int]]]:
    """The printed tables (the top level's, then one per stage of the level above, innermost
    last) and the innermost stages as (first state, end state, devices)."""
    tables: list[tuple[Row, ...]] = []
    ranges = [(0, len(states.compute), 1)]
    for depth in reversed(range(len(machines))):
        inner = []
        for start, end, devices in ranges:
            rows = _analyze(levels[depth], states.compute, start, end, machines[depth])
            tables.append(tuple(rows))
            inner += [(a, b, devices * r) for a, b, _, r in rows]
        ranges = inner
    return tuple(tables), ranges


def _data_parallel_time(states: _States, machines: Sequence[int], links: Sequence[float]) -> float:
    """PipeDream's data-parallel time per minibatch on every machine: the compute, then each
    level's ring all-reduce of all the weights, divided among that level's machines."""
    data_parallel = float(states.compute[-1])
    within = 1
    for m, bandwidth in zip(machines, links, strict=True):
        allreduce = ((4 * (m - 1) * states.parameter[-1]) / (bandwidth * m)) / within
        data_parallel = (data_parallel + allreduce) / m
        within = m
    return float(data_parallel)
