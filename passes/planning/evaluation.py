"""`evaluate`: a plan scored on its costs, the yardstick for every solver. Torch-free.

Units are seconds and bytes; a minibatch is the CostGraph's batch (one microbatch of a step for
the synchronous schedules). Each stage is priced by the cost model
(`pdcompile.passes.planning.cost_model`:
compute, transfers, all-reduce; docs/cost_model.md), and `predicted_time` is the bottleneck,
max_s time_s. Everything that depends on the schedule's order is simulated from its actions
(`pdcompile.simulate`), never re-stated: `step_time` (seconds per `train_step` call),
`rank_memory` (peak bytes per rank: weights, activations and weight versions in flight),
each stage's `memory_bytes` (its own share of its rank) and `fits_memory`.
What a stage's nodes add up to (times, bytes, cuts, tied copies) is read off the CostGraph by
`pdcompile.passes.planning.stage_sums`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdcompile.core.cluster import Cluster
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError, ScheduleError
from pdcompile.core.row_curves import curve_at
from pdcompile.passes.planning.cost_model import CostModel, get_cost_model
from pdcompile.passes.planning.plan_words import (
    ALTERNATIVE,
    LARGEST,
    alternative_of,
    largest_node,
    largest_of,
    pipeline_alternative,
)
from pdcompile.passes.planning.plans import Plan, Stage
from pdcompile.passes.planning.stage_sums import (
    cut_bytes,
    kept_activations,
    no_grad_pairs,
    node_sums,
    optimizer_call_s,
    pair_bytes,
    parameter_layout,
    row_sums,
    tie_copies,
)
from pdcompile.scheduling import PipelineSchedule, get_schedule

ROW_COSTS = "row_costs"  # plan.options key: the stages' times at each profiled row count
ROW_SCALING = "row_scaling"  # plan.options key: CostGraph.row_scaling of the costs priced


def check_plan(plan: Plan, cost_graph: CostGraph, cluster: Cluster) -> dict[str, int]:
    """Raise PartitionError unless `plan` places every node of `cost_graph` once, in a stage
    order the edges respect, on valid ranks of `cluster`; returns node -> stage."""
    stage_of: dict[str, int] = {}
    for stage in plan.stages:
        for node in stage.nodes:
            if node in stage_of:
                raise PartitionError(
                    f"node {node!r} is in stages {stage_of[node]} and {stage.index}"
                )
            stage_of[node] = stage.index
    unknown = sorted(set(stage_of) - set(cost_graph.graph))
    missing = [n for n in cost_graph.nodes if n not in stage_of]
    if unknown or missing:
        raise PartitionError(
            f"the plan does not match this graph: {len(unknown)} plan nodes are not in it "
            f"({unknown[:5]}), {len(missing)} graph nodes are in no stage ({missing[:5]}); was "
            "the plan made for another model or another coarsening?"
        )
    for u, v in cost_graph.graph.edges:
        if stage_of[u] > stage_of[v]:
            raise PartitionError(
                f"edge {u!r} -> {v!r} runs from stage {stage_of[u]} back to stage {stage_of[v]}; "
                "stages must follow the graph's order"
            )
    used = [r for s in plan.stages for r in s.ranks]
    if any(not 0 <= r < cluster.num_devices for r in used):
        raise PartitionError(
            f"the plan's ranks {used} are not all ranks of a cluster of "
            f"{cluster.num_devices} devices; was it made for another world size?"
        )
    for s in plan.stages:
        if not s.nodes:
            raise PartitionError(
                f"stage {s.index} has no nodes: the plan has more stages ({len(plan.stages)}) "
                f"than it can fill from {cost_graph.graph.number_of_nodes()} nodes; use fewer "
                "stages or a finer graph (less coarsening)"
            )
        if s.replicas != len(s.ranks) or s.replicas < 1:
            raise PartitionError(f"stage {s.index} has {s.replicas} replicas on ranks {s.ranks}")
    return stage_of


def lower_bound(cost_graph: CostGraph, cluster: Cluster | str | int) -> float:
    """Seconds per minibatch no plan beats: the total compute (the loss too) spread over every
    device at its speed (`cluster`: any spelling `Cluster.coerce` takes)."""
    return _lower_bound(cost_graph, Cluster.coerce(cluster))


def _lower_bound(cost_graph: CostGraph, cluster: Cluster) -> float:
    speeds = cluster.speed or (1.0,) * cluster.num_devices
    total = node_sums(cost_graph, cost_graph.nodes)
    return (total.compute_s + total.loss_s) / math.fsum(speeds)


def evaluate(
    plan: Plan,
    cost_graph: CostGraph,
    cluster: Cluster | str | int | None = None,
    schedule: str | None = None,
    num_microbatches: int | None = None,
    cost_model: str | CostModel | None = None,
) -> Plan:
    """Re-score any plan with pdcompile's cost model (the yardstick for comparing solvers).

    Args:
        plan: stages (nodes, ranks) from any solver.
        cost_graph: the costs the plan is scored on.
        cluster, schedule, num_microbatches: override the plan's (`cluster`: any spelling
            `Cluster.coerce` takes).
        cost_model: a registered cost model (default: the plan's option, else "pdcompile").

    Returns:
        A copy of `plan` with every stage's times and memory and the plan's predictions filled
        in (`price`); `step_time` and `rank_memory` are `simulate(plan)`'s (`simulated`).

    Raises:
        PartitionError: the plan does not fit the graph or the cluster, or its schedule cannot
            run it (e.g. a microbatch count it does not accept), or `cluster` is no cluster.
    """
    cluster = plan.cluster if cluster is None else Cluster.coerce(cluster)
    try:
        name = get_schedule(schedule or plan.schedule).name
    except ScheduleError as exc:
        raise PartitionError(str(exc)) from None
    plan = plan.with_(
        cluster=cluster, schedule=name,
        num_microbatches=num_microbatches or plan.num_microbatches,
    )  # fmt: skip
    prices = get_cost_model(cost_model or plan.options.get("cost_model", "pdcompile"))
    return simulated(price(plan, cost_graph, prices))


@dataclass(frozen=True)
class _StagePricing:
    """What pricing a plan's stages reads: the plan, its costs, schedule and cost model, and
    what its cut gives (bytes cut per stage and between stage pairs, the pairs no gradient
    flows back along, the parameter tensors and tied copies per stage, the optimizer's call)."""

    plan: Plan
    cost_graph: CostGraph
    rules: PipelineSchedule
    prices: CostModel
    cuts: Any
    pairs: Any
    silent: Any
    tensors: Any
    ties: Any
    copies: Any
    call: float

    @classmethod
    def of(
        cls,
        plan: Plan,
        cost_graph: CostGraph,
        stage_of: dict[str, int],
        rules: PipelineSchedule,
        prices: CostModel,
    ) -> _StagePricing:
        count = len(plan.stages)
        tensors, ties = parameter_layout(cost_graph, stage_of)
        return cls(
            plan, cost_graph, rules, prices, cut_bytes(cost_graph, stage_of, count),
            pair_bytes(cost_graph, stage_of), no_grad_pairs(cost_graph, stage_of), tensors, ties,
            tie_copies(cost_graph, ties, count), optimizer_call_s(cost_graph),
        )  # fmt: skip

    def stage(self, s: Stage) -> Stage:
        """Stage `s` priced: its times at its ranks' speed, transfers, all-reduce and update
        shares, and bytes."""
        plan, cost_graph, prices, pairs = self.plan, self.cost_graph, self.prices, self.pairs
        cluster, call = plan.cluster, self.call
        sums = node_sums(cost_graph, s.nodes)
        copy_params, copy_weights = self.copies[s.index]
        speed = cluster.device_speed(s.ranks)
        # the stage holding the output runs the loss: its forward, and its backward (no weights:
        # all of it in the split backward's I)
        forward, backward = (
            sums.forward_s + sums.loss_forward_s,
            sums.backward_s + sums.loss_backward_s,
        )
        # a recomputing stage runs its forward (and loss) again inside its backward (its I)
        kept = kept_activations(
            cost_graph, s.nodes, s.recompute, sum(b for (_, d), b in pairs.items() if d == s.index),
            self.rules.items_per_microbatch == 3,
        )  # fmt: skip
        again = forward if s.recompute else 0.0
        backward += again
        compute = (forward + backward) / speed
        comm = 0.0
        prev = plan.stages[s.index - 1].ranks if s.index > 0 else s.ranks
        if prev != s.ranks:  # stages on the same ranks hand their tensors over
            bandwidth = cluster.bandwidth(min(prev[0], s.ranks[0]), max(prev[-1], s.ranks[-1]))
            comm = prices.transfer_s(self.cuts[s.index], bandwidth, s.replicas)
        every = prices.updates_every(self.rules, s.replicas, plan.num_microbatches)
        ring = prices.ring_s(
            sums.grad_bytes, s.replicas, cluster.bandwidth(s.ranks[0], s.ranks[-1])
        )
        # one step() call per update, over the stage's nodes' tensors
        optimizer = (sums.optimizer_s + call) / speed if sums.optimizer_s > 0 else 0.0
        update = prices.update_s(optimizer, every)
        return Stage(
            index=s.index, nodes=s.nodes, replicas=s.replicas, ranks=s.ranks,
            forward_s=forward / speed, backward_s=backward / speed,
            backward_input_s=(sums.backward_input_s + sums.loss_backward_s + again) / speed,
            backward_weight_s=sums.backward_weight_s / speed,
            comm_s=comm, allreduce_s=ring / every,
            time_s=prices.stage_time(compute, s.replicas, comm, ring / every, update),
            recv_bytes=tuple((a, b) for (a, d), b in sorted(pairs.items()) if d == s.index),
            activation_bytes=kept.in_flight, weight_grad_activation_bytes=kept.for_weights,
            recompute=s.recompute, recompute_bytes=kept.recomputed,
            recompute_s=again / speed,
            param_bytes=sums.param_bytes + copy_params,
            grad_bytes=sums.grad_bytes + copy_params,
            weight_bytes=sums.weight_bytes + copy_weights,
            param_tensors=self.tensors[s.index],
            no_grad_from=tuple(sorted(a for a, d in self.silent if d == s.index)),
            loss_s=sums.loss_s / speed, optimizer_s=optimizer,
            accumulate_s=sums.accumulate_s / speed,
        )  # fmt: skip


def price(
    plan: Plan,
    cost_graph: CostGraph,
    prices: CostModel | None = None,
    rules: PipelineSchedule | None = None,
) -> Plan:
    """`plan`'s stages priced by the cost model (default: the plan's option, else
    "pdcompile"): times, bytes, `predicted_time`, bounds, its schedule not yet simulated
    (`step_time` 0, no `rank_memory` nor `rank_idle`). What a solver compares its candidates
    by; `evaluate` also simulates. `rules`: the plan's schedule, when the caller holds it.
    Errors as `evaluate`'s."""
    cluster, m = plan.cluster, plan.num_microbatches
    rules = rules or _rules(plan)
    prices = prices or get_cost_model(plan.options.get("cost_model", "pdcompile"))
    stage_of = check_plan(plan, cost_graph, cluster)
    pricing = _StagePricing.of(plan, cost_graph, stage_of, rules, prices)
    stages = [pricing.stage(s) for s in plan.stages]
    ties, call = pricing.ties, pricing.call
    predicted = bottleneck(stages)
    total = node_sums(cost_graph, cost_graph.nodes)
    speeds = cluster.speed or (1.0,) * cluster.num_devices
    bound = _lower_bound(cost_graph, cluster)
    everyone = cluster.num_devices
    dp_time = prices.data_parallel_time(
        (total.compute_s + total.loss_s) / min(speeds), total.grad_bytes, everyone,
        cluster.bandwidth(0, everyone - 1), prices.updates_every(rules, everyone, m),
        (total.optimizer_s + call if total.optimizer_s > 0 else 0.0) / min(speeds),
    )  # fmt: skip
    options = {k: v for k, v in row_options(plan, cost_graph).items() if k != ALTERNATIVE}
    largest = largest_node(cost_graph)
    if largest is not None:  # at the speed of the ranks running it, as the stages' times are
        holder = next((s for s in stages if largest[0] in s.nodes), None)
        slowest = min(speeds[r] for r in holder.ranks) if holder is not None else 1.0
        options[LARGEST] = [largest[0], largest[1] / slowest]
    priced = plan.with_(
        stages=tuple(stages), cluster=cluster, schedule=rules.name, num_microbatches=m,
        predicted_time=predicted, lower_bound=bound,
        gap=predicted / bound - 1 if bound > 0 else 0.0, data_parallel_time=dp_time, ties=ties,
        step_time=0.0, rank_memory=(), rank_idle=(), unpriced=unpriced(cost_graph),
        options=options,
    )  # fmt: skip
    # a data-parallel plan keeps the pipeline it was compared with, for its sentence (plan_words)
    other = pipeline_alternative(priced, cost_graph)
    return priced.with_(options={**options, ALTERNATIVE: other}) if other else priced


def row_options(plan: Plan, cost_graph: CostGraph) -> dict:
    """`plan.options` with how its costs depend on the rows: `row_scaling` (the CostGraph's),
    and where the graph has rows, `row_costs`: `{"rows": [...], "stages": [per stage, per row
    count, node_sums' forward, backward, I, W, loss forward, loss backward]}` (`rescore`
    reads a stage's times at another row count off them)."""
    options = {k: v for k, v in plan.options.items() if k not in (ROW_COSTS, ROW_SCALING)}
    options[ROW_SCALING] = cost_graph.row_scaling
    if cost_graph.rows:
        stages = [row_sums(cost_graph, s.nodes) for s in plan.stages]
        options[ROW_COSTS] = {"rows": list(cost_graph.rows), "stages": stages}
    return options


def unpriced(cost_graph: CostGraph) -> tuple[str, ...]:
    """`Plan.unpriced`: "loss" when the graph has no `loss_s`, "optimizer" when no node has
    `optimizer_s` and it names no optimizer (a model without parameters has a free step)."""
    loss = () if cost_graph.loss_s > 0 else ("loss",)
    priced = cost_graph.optimizer or any(
        d["optimizer_s"] > 0 for _, d in cost_graph.graph.nodes(data=True)
    )
    return (*loss, *(() if priced else ("optimizer",)))


def bottleneck(stages: Sequence[Stage]) -> float:
    """`Plan.predicted_time`: the busiest rank's seconds per microbatch, the sum of `time_s` over
    the stages it runs (one stage per rank: the slowest stage)."""
    load: dict[int, float] = {}
    for s in stages:
        for r in s.ranks:
            load[r] = load.get(r, 0.0) + s.time_s
    return max(load.values())


def simulated(plan: Plan, rules: PipelineSchedule | None = None) -> Plan:
    """`plan` with what its schedule's actions give on the simulator: `step_time`,
    `rank_memory`, `rank_idle`, each stage's `memory_bytes` and `fits_memory` (`rules`: the
    plan's schedule, when the caller holds it).

    Raises:
        PartitionError: the schedule cannot run the plan.
    """
    from pdcompile.passes.planning.simulator import run  # the simulator prices the schedule

    rules = rules or _rules(plan)
    try:
        sim = run(plan, rules, plan.num_microbatches, plan.cluster)
    except ScheduleError as exc:
        raise PartitionError(f"{plan.schedule} cannot run this plan: {exc}") from None
    stages = tuple(replace(s, memory_bytes=sim.stage_memory[s.index]) for s in plan.stages)
    rank_memory = tuple(sim.peak_memory)
    memory = plan.cluster.memory
    fits = memory is None or all(b <= memory for b in rank_memory)
    return plan.with_(
        stages=stages, step_time=sim.time_per_step, rank_memory=rank_memory, fits_memory=fits,
        rank_idle=tuple(sim.bubble_fraction),
    )  # fmt: skip


def rescore(
    plan: Plan,
    *,
    microbatch_size: int | None = None,
    num_microbatches: int | None = None,
    cost_model: str | CostModel | None = None,
) -> Plan:
    """The same partition at another microbatch size or count, without its CostGraph: costs
    that depend on the rows change as `CostGraph.scaled` changes them, from the plan's
    `microbatch_size`: the stages' times on their curves where the plan has them
    (`options["row_costs"]`, from a CostGraph profiled at several row counts), else linearly;
    activations and messages linearly. Then the schedule is simulated again.

    Raises:
        PartitionError: the plan has no microbatch size to scale from, or the schedule cannot
            run the new count.
    """
    rows = microbatch_size or plan.microbatch_size
    if microbatch_size is not None and not plan.microbatch_size:
        raise PartitionError("the plan has no microbatch_size to rescale from; plan it again")
    factor = rows / plan.microbatch_size if plan.microbatch_size else 1.0
    prices = get_cost_model(cost_model or plan.options.get("cost_model", "pdcompile"))
    count = num_microbatches or plan.num_microbatches
    rules = _rules(plan)
    ratios = _time_ratios(plan, rows, factor)
    stages = []
    for s, (f, b, i, w, loss, _) in zip(plan.stages, ratios, strict=True):
        again = s.recompute_s * f  # the forward a recomputing stage runs again in its backward
        forward, comm = s.forward_s * f, s.comm_s * factor
        backward = (s.backward_s - s.recompute_s) * b + again
        # one all-reduce per update: its share per microbatch follows the microbatches per update
        before = prices.updates_every(rules, s.replicas, plan.num_microbatches)
        after = prices.updates_every(rules, s.replicas, count)
        allreduce = s.allreduce_s * before / after
        # the loss scales with the rows (it is in forward and backward); the optimizer step not
        update = prices.update_s(s.optimizer_s, after)
        stages.append(replace(
            s, forward_s=forward, backward_s=backward, comm_s=comm, allreduce_s=allreduce,
            backward_input_s=(s.backward_input_s - s.recompute_s) * i + again,
            backward_weight_s=s.backward_weight_s * w, loss_s=s.loss_s * loss,
            time_s=prices.stage_time(forward + backward, s.replicas, comm, allreduce, update),
            activation_bytes=round(s.activation_bytes * factor),
            weight_grad_activation_bytes=round(s.weight_grad_activation_bytes * factor),
            recompute_bytes=round(s.recompute_bytes * factor), recompute_s=again,
            recv_bytes=tuple((src, round(n * factor)) for src, n in s.recv_bytes),
        ))  # fmt: skip
    predicted = bottleneck(stages)
    whole = ratios[-1][-1] if ratios else factor  # the whole graph's compute
    bound = plan.lower_bound * whole
    scaled = plan.with_(
        stages=tuple(stages), microbatch_size=rows, num_microbatches=count,
        predicted_time=predicted, lower_bound=bound,
        gap=predicted / bound - 1 if bound > 0 else 0.0,
        data_parallel_time=_data_parallel_time(plan, whole, prices, rules, count),
        options=_rescaled_words(plan, whole, factor, prices, rules, count),
    )  # fmt: skip
    result = simulated(scaled)
    return result.with_(options=_rescaled_searches(result, plan))


def _data_parallel_time(
    plan: Plan, whole: float, prices: CostModel, rules: PipelineSchedule, count: int
) -> float:
    """`plan.data_parallel_time` after `rescore`: its compute (the lower bound's, on one of all
    the devices at the slowest speed) grown by `whole`; its all-reduce and optimizer step per
    microbatch follow the microbatches per update, as a stage's do."""
    cluster = plan.cluster
    speeds = cluster.speed or (1.0,) * cluster.num_devices
    compute = plan.lower_bound * math.fsum(speeds) / (min(speeds) * cluster.num_devices)
    rest = max(0.0, plan.data_parallel_time - compute)
    before = prices.updates_every(rules, cluster.num_devices, plan.num_microbatches)
    after = prices.updates_every(rules, cluster.num_devices, count)
    return compute * whole + rest * before / after


def _rescaled_words(
    plan: Plan, whole: float, factor: float, prices: CostModel, rules: PipelineSchedule, count: int
) -> dict:
    """`plan.options` with the figures its sentence shows (`plan_words`) rescaled: the largest
    node's time and the compared pipeline's bottleneck grow with the compute as the whole
    graph's (`whole`), its transfers with the rows (`factor`)."""
    options = {k: v for k, v in plan.options.items() if k not in (LARGEST, ALTERNATIVE)}
    largest, other = largest_of(plan), alternative_of(plan)  # None where absent or malformed
    if largest:
        options[LARGEST] = [largest[0], largest[1] * whole]
    if other:
        before = prices.updates_every(rules, 1, plan.num_microbatches)
        after = prices.updates_every(rules, 1, count)
        parts = {"compute_s": other["compute_s"] * whole, "comm_s": other["comm_s"] * factor,
                 "other_s": other["other_s"] * before / after}  # fmt: skip
        options[ALTERNATIVE] = {**other, **parts, "predicted_time": math.fsum(parts.values())}
    return options


def _rescaled_searches(result: Plan, plan: Plan) -> dict:
    """`result.options` with the searches' tables (schedule="auto", the microbatch counts, the
    recomputation) at the rescored step: the chosen row is the rescored plan, the others' steps
    scale as its step did (they were planned at `plan`'s rows: `options["rescored_from"]`)."""
    from pdcompile.passes.planning.microbatch_count import SEARCH_KEY
    from pdcompile.passes.planning.recompute_choice import KEY
    from pdcompile.passes.planning.schedule_choice import AUTO

    options = dict(result.options)
    ratio = result.step_time / plan.step_time if plan.step_time > 0 else 1.0
    idle = result.rank_idle
    chosen = {
        "step_time": result.step_time, "predicted_time": result.predicted_time,
        "num_microbatches": result.num_microbatches, "microbatch_size": result.microbatch_size,
        "bubble": sum(idle) / len(idle) if idle else 0.0,
        "peak_memory": max(result.rank_memory, default=0), "fits_memory": result.fits_memory,
    }  # fmt: skip

    def scaled(row: Any) -> Any:  # rows of an edited file that are no rows stay as they are
        if not isinstance(row, dict) or row.get("skipped"):
            return row
        if row.get("chosen"):
            return {**row, **chosen}
        step = row.get("step_time")
        return {**row, "step_time": step * ratio} if isinstance(step, (int, float)) else row

    searched = False
    for key in (AUTO, SEARCH_KEY):
        if options.get(key) and isinstance(options[key], list):
            searched = True
            options[key] = [scaled(row) for row in options[key]]
    info = options.get(KEY)
    if isinstance(info, dict) and isinstance(info.get("without_s"), (int, float)):
        searched = True
        options[KEY] = {**info, "without_s": info["without_s"] * ratio}
    if searched and "rescored_from" not in options:
        options["rescored_from"] = {"microbatch_size": plan.microbatch_size,
                                    "num_microbatches": plan.num_microbatches}  # fmt: skip
    return options


def _time_ratios(plan: Plan, rows: int, factor: float) -> list[tuple[float, ...]]:
    """Per stage, by how much its forward, backward, I and W (each with the loss's part as
    `price` adds it), its loss, and the whole graph's compute (for the lower bound) grow from
    the plan's rows to `rows`: read off `options["row_costs"]`, else `factor` (linear)."""
    curves = plan.options.get(ROW_COSTS)
    if not curves or not plan.microbatch_size or rows == plan.microbatch_size:
        return [(factor,) * 6 for _ in plan.stages]

    def grow(old: float, new: float) -> float:
        return new / old if old > 0 else factor

    parts = []  # per stage (forward, backward, I, W, loss) before and after
    for stage in curves["stages"]:
        ends = []
        for n in (plan.microbatch_size, rows):
            f, b, i, w, lf, lb = curve_at(curves["rows"], stage, n)
            ends.append((f + lf, b + lb, i + lb, w, lf + lb))
        parts.append(ends)
    whole = grow(*(math.fsum(p[e][0] + p[e][1] for p in parts) for e in (0, 1)))
    return [(*(grow(x, y) for x, y in zip(old, new, strict=True)), whole) for old, new in parts]


def _rules(plan: Plan) -> PipelineSchedule:
    """The plan's schedule, looked up by name.

    Raises:
        PartitionError: no schedule has that name.
    """
    try:
        return plan.rules
    except ScheduleError as exc:
        raise PartitionError(str(exc)) from None
