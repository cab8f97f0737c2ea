"""`evaluate`: a plan scored on its costs, the yardstick for every solver. Torch-free.

Units are seconds and bytes; a minibatch is the CostGraph's batch (one microbatch of a step for
the synchronous schedules). Each stage is priced by the cost model (`pdcompile.cost_model`:
compute, transfers, all-reduce; docs/cost_model.md), and `predicted_time` is the bottleneck,
max_s time_s. Everything that depends on the schedule's order is simulated from its actions
(`pdcompile.simulate`), never re-stated: `step_time` (seconds per `train_step` call),
`rank_memory` (peak bytes per rank: weights, activations and weight versions in flight),
each stage's `memory_bytes` (its own share of its rank) and `fits_memory`.

cut_s is the bytes of the tensors produced before stage s and used at or after it (a skip
connection is charged at every boundary it crosses), sent forward as activations and back as
gradients, and charged to the stage after the boundary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdcompile.cluster import Cluster
from pdcompile.cost_graph import CostGraph
from pdcompile.cost_model import CostModel, get_cost_model
from pdcompile.errors import PartitionError, ScheduleError
from pdcompile.plans import Plan, Stage
from pdcompile.schedules import get_schedule


@dataclass(frozen=True)
class NodeSums:
    """What a set of nodes costs: compute split in forward/backward (and the backward in its
    input- and weight-gradient parts), and memory parts."""

    forward_s: float
    backward_s: float
    grad_bytes: int
    weight_bytes: int  # parameters + gradients + optimizer state
    param_bytes: int
    activation_bytes: int
    backward_input_s: float = 0.0
    backward_weight_s: float = 0.0
    weight_grad_activation_bytes: int = 0  # of activation_bytes, kept until W
    loss_forward_s: float = 0.0  # the loss function, where the nodes hold the loss node
    loss_backward_s: float = 0.0  # (not in forward_s and backward_s: those are the nodes')
    optimizer_s: float = 0.0  # one optimizer step over the nodes' parameters

    @property
    def compute_s(self) -> float:
        """The nodes' forward and backward, without the loss."""
        return self.forward_s + self.backward_s

    @property
    def loss_s(self) -> float:
        return self.loss_forward_s + self.loss_backward_s


def node_sums(cost_graph: CostGraph, nodes: Sequence[str]) -> NodeSums:
    """Sums over `nodes`; data-source (kind "input") nodes have no compute. Where `nodes` hold
    the graph's `loss_node`, `loss_forward_s` and `loss_backward_s` are the loss function's
    (kept apart: the times are the nodes' own; `price` adds them to the stage's)."""
    attrs = [cost_graph.graph.nodes[n] for n in nodes]
    compute = [a for a in attrs if a["kind"] != "input"]
    loss = cost_graph.loss_node in nodes and cost_graph.loss_s > 0
    loss_forward, loss_backward = (
        (cost_graph.loss_forward_s, cost_graph.loss_backward_s) if loss else (0.0, 0.0)
    )
    return NodeSums(
        forward_s=math.fsum(a["forward_s"] for a in compute),
        backward_s=math.fsum(a["backward_s"] for a in compute),
        grad_bytes=sum(a["grad_bytes"] for a in attrs),
        weight_bytes=sum(a["param_bytes"] + a["grad_bytes"] + a["optimizer_bytes"] for a in attrs),
        param_bytes=sum(a["param_bytes"] for a in attrs),
        activation_bytes=sum(a["activation_bytes"] for a in attrs),
        backward_input_s=math.fsum(a["backward_input_s"] for a in compute),
        backward_weight_s=math.fsum(a["backward_weight_s"] for a in compute),
        weight_grad_activation_bytes=sum(a["weight_grad_activation_bytes"] for a in attrs),
        loss_forward_s=loss_forward,
        loss_backward_s=loss_backward,
        optimizer_s=math.fsum(a["optimizer_s"] for a in attrs),
    )


def producer_bytes(cost_graph: CostGraph, node: str) -> int:
    """Bytes a node's output sends across a boundary (once, however many nodes read it)."""
    return max((b for _, _, b in cost_graph.graph.out_edges(node, data="bytes")), default=0)


def cut_bytes(cost_graph: CostGraph, stage_of: dict[str, int], num_stages: int) -> list[int]:
    """Bytes crossing into each stage from earlier stages (cut_0 = 0)."""
    cuts = [0] * num_stages
    for u in cost_graph.graph:
        last = max((stage_of[v] for v in cost_graph.graph.successors(u)), default=stage_of[u])
        for s in range(stage_of[u] + 1, last + 1):
            cuts[s] += producer_bytes(cost_graph, u)
    return cuts


def pair_bytes(cost_graph: CostGraph, stage_of: dict[str, int]) -> dict[tuple[int, int], int]:
    """Bytes each stage sends each later stage per minibatch: a value goes once to every stage
    that reads it, straight from its producer's stage (as code generation's channels do)."""
    pairs: dict[tuple[int, int], int] = {}
    for u in cost_graph.graph:
        sent: dict[int, int] = {}
        for _, v, b in cost_graph.graph.out_edges(u, data="bytes"):
            if stage_of[v] != stage_of[u]:
                sent[stage_of[v]] = max(sent.get(stage_of[v], 0), b)
        for dst, b in sent.items():
            pairs[(stage_of[u], dst)] = pairs.get((stage_of[u], dst), 0) + b
    return pairs


def no_grad_pairs(cost_graph: CostGraph, stage_of: dict[str, int]) -> set[tuple[int, int]]:
    """The stage pairs whose tensors carry no gradient back (every edge between them has
    `grad` False: integer ids, masks, values outside autograd)."""
    carries: dict[tuple[int, int], bool] = {}
    for u, v, grad in cost_graph.graph.edges(data="grad", default=True):
        pair = (stage_of[u], stage_of[v])
        if pair[0] != pair[1]:
            carries[pair] = carries.get(pair, False) or grad
    return {pair for pair, grad in carries.items() if not grad}


def parameter_layout(
    cost_graph: CostGraph, stage_of: dict[str, int]
) -> tuple[list[int], tuple[tuple[tuple[int, ...], int], ...]]:
    """Parameter tensors per stage (a tied tensor's copies included) and the tie groups:
    `(stages, gradient bytes)` per tensor with gradients that nodes of several stages use.

    Reads the CostGraph's `meta["param_tensors"]` and `meta["ties"]` (written by `analyze`;
    absent from imported profiles, which then count no tensors and no ties). Names of original
    nodes map to stages through each node's `members`; names the graph lacks are ignored.

    Raises:
        PartitionError: those meta entries are malformed.
    """
    member_stage = {
        member: stage_of[node]
        for node, members in cost_graph.graph.nodes(data="members")
        for member in members
    }
    counts, listed = cost_graph.meta.get("param_tensors", {}), cost_graph.meta.get("ties", [])
    valid = isinstance(counts, dict) and isinstance(listed, list)
    valid = valid and all(isinstance(n, int) and not isinstance(n, bool) for n in counts.values())
    valid = valid and all(
        isinstance(t, dict) and isinstance(t.get("nodes"), list)
        and isinstance(t.get("grad_bytes"), int) for t in listed
    )  # fmt: skip
    if not valid:
        raise PartitionError(
            "the CostGraph's meta has a malformed 'param_tensors' (node -> count) or 'ties' "
            "([{'nodes': [...], 'grad_bytes': n}, ...]); remove both or profile again with "
            "pdcompile.analyze"
        )
    tensors = [0] * (max(stage_of.values(), default=-1) + 1)
    for node, count in counts.items():
        if node in member_stage:
            tensors[member_stage[node]] += count
    ties = []
    for tie in listed:
        users = [member_stage[n] for n in tie["nodes"] if n in member_stage]
        stages = tuple(sorted(set(users)))
        if len(stages) > 1:
            ties.append((stages, tie["grad_bytes"]))
            for stage in stages:
                tensors[stage] += stage != users[0]  # a copy of the owner's tensor
    return tensors, tuple(ties)


def tie_copies(
    cost_graph: CostGraph, ties: Sequence[tuple[tuple[int, ...], int]], count: int
) -> list[tuple[int, int]]:
    """Per stage, the (parameter, weight) bytes of the tied tensors' copies it holds besides its
    nodes': the first stage of a tie holds the tensor its first user owns (in that node's
    bytes); every later one a copy with its gradient and optimizer state (at the graph's ratio
    of optimizer state to parameters)."""
    totals = cost_graph.totals()
    state = totals["optimizer_bytes"] / totals["param_bytes"] if totals["param_bytes"] else 0.0
    copies = [(0, 0)] * count
    for stages, nbytes in ties:
        for t in stages[1:]:
            params, weights = copies[t]
            copies[t] = (params + nbytes, weights + round(nbytes * (2 + state)))
    return copies


def optimizer_call_s(cost_graph: CostGraph) -> float:
    """The optimizer's fixed seconds per `step()` call (`meta["optimizer_call_s"]`, written by
    `analyze`; 0 without), which a stage with parameters to update pays once per update on
    top of its nodes' `optimizer_s`.

    Raises:
        PartitionError: the entry is not a number >= 0.
    """
    value = cost_graph.meta.get("optimizer_call_s", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise PartitionError(
            f"the CostGraph's meta has optimizer_call_s={value!r}; it must be seconds >= 0: "
            "remove it or profile again with pdcompile.analyze"
        )
    return float(value)


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
    cluster = Cluster.coerce(cluster)
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


def price(plan: Plan, cost_graph: CostGraph, prices: CostModel | None = None) -> Plan:
    """`plan`'s stages priced by the cost model (default: the plan's option, else
    "pdcompile"): times, bytes, `predicted_time`, bounds, its schedule not yet simulated
    (`step_time` 0, no `rank_memory` nor `rank_idle`). What a solver compares its candidates
    by; `evaluate` also simulates. Errors as `evaluate`'s."""
    cluster, m = plan.cluster, plan.num_microbatches
    try:
        rules = get_schedule(plan.schedule)
    except ScheduleError as exc:
        raise PartitionError(str(exc)) from None
    prices = prices or get_cost_model(plan.options.get("cost_model", "pdcompile"))
    stage_of = check_plan(plan, cost_graph, cluster)
    count = len(plan.stages)
    cuts = cut_bytes(cost_graph, stage_of, count)
    pairs = pair_bytes(cost_graph, stage_of)
    silent = no_grad_pairs(cost_graph, stage_of)
    stages = []
    tensors, ties = parameter_layout(cost_graph, stage_of)
    copies = tie_copies(cost_graph, ties, count)
    call = optimizer_call_s(cost_graph)
    for s in plan.stages:
        sums = node_sums(cost_graph, s.nodes)
        copy_params, copy_weights = copies[s.index]
        speed = cluster.device_speed(s.ranks)
        # the stage holding the output runs the loss: its forward, and its backward (no weights:
        # all of it in the split backward's I)
        forward, backward = (
            sums.forward_s + sums.loss_forward_s,
            sums.backward_s + sums.loss_backward_s,
        )
        compute = (forward + backward) / speed
        comm = 0.0
        prev = plan.stages[s.index - 1].ranks if s.index > 0 else s.ranks
        if prev != s.ranks:  # stages on the same ranks hand their tensors over
            bandwidth = cluster.bandwidth(min(prev[0], s.ranks[0]), max(prev[-1], s.ranks[-1]))
            comm = prices.transfer_s(cuts[s.index], bandwidth, s.replicas)
        every = prices.updates_every(rules.name, s.replicas, m)
        ring = prices.ring_s(
            sums.grad_bytes, s.replicas, cluster.bandwidth(s.ranks[0], s.ranks[-1])
        )
        # one step() call per update, over the stage's nodes' tensors
        optimizer = (sums.optimizer_s + call) / speed if sums.optimizer_s > 0 else 0.0
        update = prices.update_s(optimizer, every)
        stages.append(
            Stage(
                index=s.index, nodes=s.nodes, replicas=s.replicas, ranks=s.ranks,
                forward_s=forward / speed, backward_s=backward / speed,
                backward_input_s=(sums.backward_input_s + sums.loss_backward_s) / speed,
                backward_weight_s=sums.backward_weight_s / speed,
                comm_s=comm, allreduce_s=ring / every,
                time_s=prices.stage_time(compute, s.replicas, comm, ring / every, update),
                recv_bytes=tuple((a, b) for (a, d), b in sorted(pairs.items()) if d == s.index),
                activation_bytes=sums.activation_bytes,
                weight_grad_activation_bytes=sums.weight_grad_activation_bytes,
                param_bytes=sums.param_bytes + copy_params,
                grad_bytes=sums.grad_bytes + copy_params,
                weight_bytes=sums.weight_bytes + copy_weights,
                param_tensors=tensors[s.index],
                no_grad_from=tuple(sorted(a for a, d in silent if d == s.index)),
                loss_s=sums.loss_s / speed, optimizer_s=optimizer,
            )
        )  # fmt: skip
    predicted = bottleneck(stages)
    total = node_sums(cost_graph, cost_graph.nodes)
    speeds = cluster.speed or (1.0,) * cluster.num_devices
    bound = lower_bound(cost_graph, cluster)
    everyone = cluster.num_devices
    dp_time = prices.data_parallel_time(
        (total.compute_s + total.loss_s) / min(speeds), total.grad_bytes, everyone,
        cluster.bandwidth(0, everyone - 1), prices.updates_every(rules.name, everyone, m),
        (total.optimizer_s + call if total.optimizer_s > 0 else 0.0) / min(speeds),
    )  # fmt: skip
    return plan.with_(
        stages=tuple(stages), cluster=cluster, schedule=rules.name, num_microbatches=m,
        predicted_time=predicted, lower_bound=bound,
        gap=predicted / bound - 1 if bound > 0 else 0.0, data_parallel_time=dp_time, ties=ties,
        step_time=0.0, rank_memory=(), rank_idle=(), unpriced=unpriced(cost_graph),
    )  # fmt: skip


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


def simulated(plan: Plan) -> Plan:
    """`plan` with what its schedule's actions give on the simulator: `step_time`,
    `rank_memory`, `rank_idle`, each stage's `memory_bytes` and `fits_memory`.

    Raises:
        PartitionError: the schedule cannot run the plan.
    """
    from pdcompile.runtime.simulator import run  # the simulator prices the schedule

    try:
        sim = run(plan, get_schedule(plan.schedule), plan.num_microbatches, plan.cluster)
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
    that scale with the rows (compute, activations, messages) scale linearly from the plan's
    `microbatch_size`, as `CostGraph.scaled` scales them; then the schedule is simulated again.

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
    stages = []
    for s in plan.stages:
        forward, backward, comm = s.forward_s * factor, s.backward_s * factor, s.comm_s * factor
        # one all-reduce per update: its share per microbatch follows the microbatches per update
        before = prices.updates_every(plan.schedule, s.replicas, plan.num_microbatches)
        after = prices.updates_every(plan.schedule, s.replicas, count)
        allreduce = s.allreduce_s * before / after
        # the loss scales with the rows (it is in forward and backward); the optimizer step not
        update = prices.update_s(s.optimizer_s, after)
        stages.append(replace(
            s, forward_s=forward, backward_s=backward, comm_s=comm, allreduce_s=allreduce,
            backward_input_s=s.backward_input_s * factor,
            backward_weight_s=s.backward_weight_s * factor, loss_s=s.loss_s * factor,
            time_s=prices.stage_time(forward + backward, s.replicas, comm, allreduce, update),
            activation_bytes=round(s.activation_bytes * factor),
            weight_grad_activation_bytes=round(s.weight_grad_activation_bytes * factor),
            recv_bytes=tuple((src, round(b * factor)) for src, b in s.recv_bytes),
        ))  # fmt: skip
    predicted = bottleneck(stages)
    bound = plan.lower_bound * factor
    scaled = plan.with_(
        stages=tuple(stages), microbatch_size=rows, num_microbatches=count,
        predicted_time=predicted, lower_bound=bound,
        gap=predicted / bound - 1 if bound > 0 else 0.0,
    )  # fmt: skip
    return simulated(scaled)
