"""`plan(..., memory=, recompute=)`: activation recomputation chosen per stage so that every rank
fits. Torch-free.

Under a memory limit (`memory`, else `Cluster.memory`) `plan()` weighs three kinds of plan and
returns the fastest (simulated `step_time`) whose every rank fits:

- **none**: the solver's plan under the limit without recomputation (its memory counts make it
  cut deeper or replicate less where activations do not fit);
- **recomputed, the fastest cut**: the plan the solver makes without the limit, every stage
  recomputing, then relaxed;
- **recomputed, cut for it**: the solver's plan of the graph as a recomputing pipeline sees it
  (`recompute_view`: no activation kept, every backward longer by its forward) under a share of
  the limit, the share bisected over `TRIES` cuts against the simulated ranks as
  `planning._plan_chunks` bisects its budget; then relaxed.

Each stage recomputing starts at whichever of its forms gives the smaller simulated peak where
it runs: whole (keeps its inputs, its backward holds one forward's activations) or segments
(`segment_boundaries`: keeps each segment's inputs, holds one segment's activations), in ⌈√n⌉
segments (the √n rule) or in `COUNTS` (fewer segments keep less per microbatch in flight). Relaxing
then turns recomputation off stage by stage, the most expensive first (its `recompute_s`), while
every rank still fits: only the stages that need it recompute. `recompute=True` forces every
stage to recompute (its form still chosen), `False` forbids it (the solver's plan, as without
this search). The chosen plan's `options["recomputation"]` says what it costs: the step time of
the same plan without recomputation and the slowdown (`recompute_table`).

When no plan fits, `PartitionError` names the least memory a plan tried needs and the stage
that sets it. `memory="auto"` is this host's: see `host_memory`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pdcompile.core.cluster import Cluster, parse_bytes
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError
from pdcompile.core.message_buffers import stage_bytes
from pdcompile.core.text import human_bytes, human_seconds
from pdcompile.passes.planning.evaluation import price, simulated
from pdcompile.passes.planning.microbatch_count import fastest_fitting
from pdcompile.passes.planning.plan_config import PlanConfig, Planner
from pdcompile.passes.planning.plans import Plan, Stage
from pdcompile.passes.planning.stage_sums import edge_bytes, producer_bytes
from pdcompile.scheduling import get_schedule

AUTO = "auto"
MARGIN = 0.10  # of the device's memory `memory="auto"` leaves free (allocator, context, transients)
TRIES = 4  # cuts of the recomputing pipeline, bisecting the solver's share of the limit
KEY = "recomputation"  # plan.options key of what recomputation costs
COUNTS = (2, 3)  # segment counts tried besides the √n rule's

Recompute = bool | tuple[str, ...]


def host_memory(local_ranks: int, total: float | None = None) -> float:
    """`memory="auto"`: `total` (a device's memory: `compile` passes CUDA's) or, without it,
    this host's available RAM (`/proc/meminfo`'s MemAvailable, else `os.sysconf`) divided by
    the `local_ranks` sharing it, less `MARGIN`."""
    found = f"the device's {human_bytes(total)}" if total is not None else ""
    if total is None:
        ram = _available_ram()
        total = ram / max(1, local_ranks)
        found = f"{human_bytes(ram)} of available RAM over {max(1, local_ranks)} ranks"
    if not (math.isfinite(total) and total > 0):
        raise PartitionError(
            f"memory='auto' found {found} ({total!r} bytes per rank): this host reports no "
            "memory to plan with; pass memory= the bytes per device (e.g. memory='16GB') or None "
            "(no limit)"
        )
    return total * (1 - MARGIN)


def _available_ram() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def limited(cluster: Cluster, memory: Any, local_ranks: int | None = None) -> Cluster:
    """`cluster` with `memory` bytes per device (a number, a size such as "16GB", or "auto":
    `host_memory` over `local_ranks`, default the devices of the cluster's innermost level);
    None keeps the cluster's own.

    Raises:
        PartitionError: `memory` is none of those, or not positive.
    """
    if memory is None:
        return cluster
    if memory == AUTO:
        memory = host_memory(local_ranks or cluster.levels[0].count)
    return Cluster.from_dict({**cluster.to_dict(), "memory": check_memory(memory)})


def check_memory(memory: Any) -> float | str | None:
    """`memory=` checked: None, "auto", or its bytes per device (a finite number > 0).

    Raises:
        PartitionError: anything else, naming `memory=` and the value.
    """
    if memory is None or (isinstance(memory, str) and memory == AUTO):
        return memory
    number = isinstance(memory, (int, float)) and not isinstance(memory, bool)
    if not (number or isinstance(memory, str)):
        raise PartitionError(
            f"memory must be bytes per device (a number, or a size such as '16GB'), 'auto' or "
            f"None, got {memory!r}"
        )
    found = parse_bytes(memory, "memory")
    if not (math.isfinite(found) and found > 0):
        raise PartitionError(
            f"memory={memory!r} is {found!r} bytes per device: give a size > 0 (e.g. '16GB'), "
            "'auto' (this host's) or None (no limit)"
        )
    return found


def check_recompute(recompute: Any) -> None:
    """Raise `PartitionError` unless `recompute` is None, True or False."""
    if recompute is not None and not isinstance(recompute, bool):
        raise PartitionError(
            f"recompute must be None (the planner decides), True (every stage) or False "
            f"(none), got {recompute!r}; a stage's own segment boundaries go in Stage.recompute"
        )


def segment_boundaries(
    cost_graph: CostGraph, nodes: Sequence[str], count: int | None = None
) -> tuple[str, ...]:
    """A stage of n computing nodes cut into `count` segments (default ⌈√n⌉, the √n rule of
    Chen et al., 2016) of about equal activation bytes: each boundary the node of the smallest
    output within half a segment of its share (what every microbatch keeps), computing one
    value (no `getitem` reads it); its last member names it. () where no cut is possible."""
    g = cost_graph.graph
    inside = [n for n in cost_graph.nodes if n in set(nodes) and g.nodes[n]["kind"] == "compute"]
    count = count or math.ceil(math.sqrt(len(inside)))
    total = sum(g.nodes[n]["activation_bytes"] for n in inside)
    if count < 2 or total == 0:
        return ()
    spots, running = [], 0  # (activation bytes up to and with the node, output bytes, node)
    for n in inside[:-1]:
        running += g.nodes[n]["activation_bytes"]
        single = not any(
            str(g.nodes[v].get("description", "")).endswith("operator.getitem")
            for v in g.successors(n)
        )
        if single and producer_bytes(cost_graph, n):
            spots.append((running, producer_bytes(cost_graph, n), n))
    share, chosen = total / count, []
    for k in range(1, count):
        near = [p for p in spots if abs(p[0] - k * share) <= share / 2 and p[2] not in chosen]
        if near:
            chosen.append(min(near, key=lambda p: (p[1], abs(p[0] - k * share)))[2])
    return tuple(g.nodes[n]["members"][-1] for n in inside if n in chosen)


def recompute_view(cost_graph: CostGraph) -> CostGraph:
    """The graph as a pipeline whose every stage recomputes sees it, for a solver: no activation
    kept per microbatch (what a stage keeps, its inputs, the simulation counts) and every
    backward (and I) longer by its forward, the loss's too."""
    view = cost_graph.copy()
    for _, data in view.graph.nodes(data=True):
        data["backward_s"] += data["forward_s"]
        data["backward_input_s"] += data["forward_s"]
        data["memory_bytes"] -= data["activation_bytes"]
        data["activation_bytes"] = data["weight_grad_activation_bytes"] = 0
        if data["row_s"] is not None:  # at every profiled row count alike
            data["row_s"] = tuple((f, b + f, i + f, w) for f, b, i, w in data["row_s"])
    view.loss_backward_s += view.loss_forward_s
    if view.loss_row_s is not None:
        view.loss_row_s = tuple((f, b + f) for f, b in view.loss_row_s)
    return view


def with_recompute(plan: Plan, cost_graph: CostGraph, choice: Sequence[Recompute]) -> Plan:
    """`plan` priced and simulated with `choice[s]` as stage s's recomputation."""
    stages = tuple(replace(s, recompute=c) for s, c in zip(plan.stages, choice, strict=True))
    return simulated(price(plan.with_(stages=stages), cost_graph))


def plan_recompute(inner: Planner, cost_graph: CostGraph, config: PlanConfig) -> Plan:
    """With `recompute=True`, or None under a memory limit, the fastest fitting plan of the
    three kinds the module describes, `inner` (the planner's next layer) cutting each with
    `recompute=False`; else `inner`'s plan.

    Raises:
        PartitionError: no plan fits (naming the least memory one tried needs and the stage
            that sets it), or the solver cannot plan at all.
    """
    recompute, cluster = config.recompute, config.cluster
    if not (recompute is True or (recompute is None and cluster.memory is not None)):
        return inner(cost_graph, config)
    size = config.microbatch_size
    costs = cost_graph.scaled(size) if size and size != cost_graph.batch_size else cost_graph
    off = config.replace(recompute=False)
    free = inner(cost_graph, off.replace(cluster=_unlimited(cluster)))
    candidates: list[Plan] = []
    if recompute is None:
        try:
            base = inner(cost_graph, off)
        except PartitionError:
            base = None
        if base is not None and base.fits_memory:
            if base.step_time <= free.step_time:  # the limit cost nothing
                return base
            candidates.append(base)
    on = [_recomputing(free.with_(cluster=cluster), costs, recompute)]
    on += _cut_for_recomputation(inner, off, cost_graph, costs, recompute)
    chunks = config.chunks or config.rules.default_chunks
    if chunks == 1 and 1 in (config.replica_counts or (1,)):  # one stage per device
        try:
            least = least_memory(costs, free.with_(cluster=cluster))
        except PartitionError:  # the schedule does not run that many stages (e.g. 2bw, M < S)
            pass
        else:
            on.append(_recomputing(least, costs, recompute))
    candidates += [p for p in on if p.fits_memory]
    if not candidates:
        raise PartitionError(_no_fit(on, cluster.memory))
    best = candidates[fastest_fitting(candidates)]
    return _annotated(best, costs, cluster.memory)


def _unlimited(cluster: Cluster, memory: float | None = None) -> Cluster:
    """`cluster` with `memory` bytes per device (None: no limit)."""
    return Cluster.from_dict({**cluster.to_dict(), "memory": memory})


def _recomputing(plan: Plan, costs: CostGraph, recompute: bool | None) -> Plan:
    """Every stage recomputing in its form of the smaller peak, then (`recompute` None) each
    turned off, the most expensive first, while every rank still fits."""
    choice: list[Recompute] = [True] * plan.num_stages
    current = with_recompute(plan, costs, choice)
    for s, stage in enumerate(plan.stages):
        forms = {segment_boundaries(costs, stage.nodes, k) for k in (*COUNTS, None)} - {()}
        for boundaries in sorted(forms):
            trial = with_recompute(plan, costs, [*choice[:s], boundaries, *choice[s + 1 :]])
            if _peak(trial, stage.ranks) < _peak(current, stage.ranks) and max(
                trial.rank_memory
            ) <= max(current.rank_memory):  # lower where the stage runs, higher nowhere
                choice[s], current = boundaries, trial
    if recompute is True or not current.fits_memory:
        return current
    for stage in sorted(current.stages, key=lambda st: -st.recompute_s):
        trial = with_recompute(current, costs, [
            False if i == stage.index else c for i, c in enumerate(choice)
        ])  # fmt: skip
        if trial.fits_memory:
            choice[stage.index], current = False, trial
    return current


def _peak(plan: Plan, ranks: Sequence[int]) -> int:
    return max(plan.rank_memory[r] for r in ranks)


def _cut_for_recomputation(
    inner: Planner, off: PlanConfig, cost_graph: CostGraph, costs: CostGraph,
    recompute: bool | None,
) -> list[Plan]:  # fmt: skip
    """The solver's plans of the `recompute_view` (`inner` under `off`, recompute=False), its
    share of the limit bisected: a plan that fits once recomputing raises the share, one that
    does not (or no plan) lowers it."""
    view, cluster = recompute_view(cost_graph), off.cluster
    limit = cluster.memory
    if limit is None:  # recompute=True alone: the cut for it, once
        cut = inner(view, off)
        return [_recomputing(cut.with_(cluster=cluster), costs, recompute)]
    low, high, share = 0.0, 2.0, 1.0
    found = []
    for _ in range(TRIES):
        try:
            cut = inner(view, off.replace(cluster=_unlimited(cluster, share * limit)))
        except PartitionError:
            low, share = share, (share + high) / 2
            continue
        result = _recomputing(cut.with_(cluster=cluster), costs, recompute)
        found.append(result)
        if result.fits_memory:
            low = share
        else:
            high = share
        share = (low + high) / 2
    return found


def least_memory(costs: CostGraph, like: Plan) -> Plan:
    """The straight pipeline of one stage per device of `like`'s cluster (its schedule and
    microbatches) whose largest stage needs the least memory with every stage recomputing,
    cut from the graph's order: the memory bisected, each try cutting stages greedily from the
    last, each as long as its charge allows (weights, `memory_counts` x its inputs, one
    forward's activations during its backward). Simulated: its peaks are exact."""
    order = costs.nodes
    charge = _RecomputingCharge(costs, like)
    whole = charge(0, len(order), charge.devices - 1)  # no messages: bound a cut's by the largest
    low, high = 0.0, float(whole + stage_bytes(max(charge.edges), max(charge.edges))) * 2 + 1
    best = _greedy_cut(charge, len(order), high)
    for _ in range(40):
        middle = (low + high) / 2
        found = _greedy_cut(charge, len(order), middle)
        if found is None:
            low = middle
        else:
            high, best = middle, found
    assert best is not None
    bounds = [*best, len(order)]
    stages = tuple(
        Stage(index=i, nodes=tuple(order[a:b]), replicas=1, ranks=(i,))
        for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
    )
    return with_recompute(like.with_(stages=stages, solver="least-memory"), costs,
                          [True] * len(stages))  # fmt: skip


class _RecomputingCharge:
    """`charge(j, k, s)`: the bytes stage s of a straight pipeline of one stage per device of
    `like`'s cluster holds when it is positions [j, k) of the graph's order and recomputes:
    its weights, `memory_counts` x its inputs (the bytes crossing into j and the graph inputs it
    reads), and one forward's activations during its backward."""

    def __init__(self, costs: CostGraph, like: Plan) -> None:
        g, order = costs.graph, costs.nodes
        self.devices = like.cluster.num_devices
        self.rules = get_schedule(like.schedule)
        self.microbatches = like.num_microbatches
        position = {n: i for i, n in enumerate(order)}
        self.into = [0] * (len(order) + 1)  # bytes crossing into position i (from before it)
        for u in order:
            last = max((position[v] for v in g.successors(u)), default=position[u])
            for i in range(position[u] + 1, last + 1):
                self.into[i] += producer_bytes(costs, u)
        self.edges = edge_bytes(costs, order)  # of the edges across each boundary
        self.params = _prefix_sums(costs, "param_bytes")
        self.grads = _prefix_sums(costs, "grad_bytes")
        optimizer = _prefix_sums(costs, "optimizer_bytes")
        self.weights = [
            p + gr + o for p, gr, o in zip(self.params, self.grads, optimizer, strict=True)
        ]
        self.acts = _prefix_sums(costs, "activation_bytes")
        self.sources = [0]
        for n in order:
            kind = g.nodes[n]["kind"]
            self.sources.append(
                self.sources[-1] + (producer_bytes(costs, n) if kind == "input" else 0)
            )

    def __call__(self, j: int, k: int, s: int) -> float:
        """The bytes of positions [j, k) as stage s."""
        devices = self.devices
        counts = self.rules.memory_counts(devices - s, devices - 1 - s, self.microbatches,
                                          devices - 1)  # fmt: skip
        kept = self.into[j] + self.sources[k] - self.sources[j]
        held = counts.charges(self.weights[k] - self.weights[j], self.grads[k] - self.grads[j],
                              self.params[k] - self.params[j], kept, kept)  # fmt: skip
        return max(held) + self.acts[k] - self.acts[j] + stage_bytes(self.edges[j], self.edges[k])


def _prefix_sums(costs: CostGraph, key: str) -> list[int]:
    """`key` summed over the first i nodes of the graph's order, for i = 0..n."""
    values = [0]
    for n in costs.nodes:
        values.append(values[-1] + costs.graph.nodes[n][key])
    return values


def _greedy_cut(charge: _RecomputingCharge, n: int, limit: float) -> list[int] | None:
    """The starts of the stages cut from the last, each as long as `charge` stays within
    `limit`, one per device; None if they do not cover all n positions."""
    ends, k = [], n
    for s in range(charge.devices - 1, -1, -1):
        j = k
        while j > 0 and charge(j - 1, k, s) <= limit:
            j -= 1
        if j == k:
            return None
        ends.append(j)
        k = j
        if k == 0:
            return sorted(ends)
    return None


def _annotated(plan: Plan, costs: CostGraph, limit: float) -> Plan:
    """`plan` with `options["recomputation"]`: the limit, the same plan's step without
    recomputation and the slowdown recomputing costs."""
    without = with_recompute(plan, costs, [False] * plan.num_stages)
    info = {
        "limit": limit,
        "without_s": without.step_time,
        "without_peak": max(without.rank_memory),
        "slowdown": plan.step_time / without.step_time - 1 if without.step_time else 0.0,
        "stages": [s.index for s in plan.stages if s.recompute],
    }
    return plan.with_(options={**plan.options, KEY: info})


def _no_fit(plans: Sequence[Plan], limit: float) -> str:
    """The message when nothing fits: the least memory a plan tried needs, the stage setting
    it and its parts."""
    least = min(plans, key=lambda p: max(p.rank_memory))
    need = max(least.rank_memory)
    rank = least.rank_memory.index(need)
    stage = max((s for s in least.stages if rank in s.ranks), key=lambda s: s.memory_bytes)
    how = "recomputing" if stage.recompute else "keeping its activations"
    return (
        f"no plan fits {human_bytes(limit)} per device: the least a plan tried needs is "
        f"{human_bytes(need)} ({need:.0f} B), on rank {rank}, set by stage {stage.index} "
        f"({len(stage.nodes)} nodes {stage.nodes[0]}..{stage.nodes[-1]}: weights "
        f"{human_bytes(stage.weight_bytes)}, {human_bytes(stage.activation_bytes)} kept per "
        f"microbatch, {how}); give memory of at least {human_bytes(need)}, more devices, or "
        "fewer microbatches in flight (fewer microbatches, or a schedule that holds fewer)"
    )  # fmt: skip


def _form(recompute: Recompute) -> str:
    if recompute is True:
        return "whole"
    return f"{len(recompute)} boundar{'y' if len(recompute) == 1 else 'ies'}"


def recompute_table(plan: Plan) -> str:
    """The stages that recompute and, where the planner chose it (`options["recomputation"]`),
    what it costs, as text; "" for a plan that neither recomputes nor was planned under a
    limit."""
    info = plan.options.get(KEY)
    if not info and not any(s.recompute for s in plan.stages):
        return ""
    stages = ", ".join(
        f"stage {s.index} {_form(s.recompute)}"
        f" (+{human_seconds(s.recompute_s)} per backward, keeps "
        f"{human_bytes(s.activation_bytes)} per microbatch)"
        for s in plan.stages
        if s.recompute
    )
    if not info:
        return f"recomputation: {stages}"
    limit = info["limit"]
    return (
        f"recomputation {f'under {human_bytes(limit)} per device' if limit else 'forced'}: "
        f"{stages or 'none needed'}; step {human_seconds(plan.step_time)} against "
        f"{human_seconds(info['without_s'])} without it (predicted slowdown "
        f"{info['slowdown']:+.1%}, peak {human_bytes(info['without_peak'])} without it)"
    )
