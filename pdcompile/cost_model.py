"""pdcompile's cost model for plans, and `evaluate`: the yardstick for every solver. Torch-free.

Units are seconds and bytes; a minibatch is the CostGraph's batch (one microbatch of a step for
the synchronous schedules). For stage s on ranks R_s (r_s replicas, slowest speed sigma_s), with
S stages and M microbatches (docs/cost_model.md has the derivations):

    compute_s   = sum over its non-input nodes of (forward + backward) / sigma_s
    comm_s      = 2 * cut_s / bw(ranks of stage s-1 and s) / r_s            (0 for s = 0)
    allreduce_s = 2 (r_s - 1) / r_s * grad_bytes_s / bw(R_s) / u_s,   u_s = r_s (pipedream) or M
    time_s      = compute_s / r_s + comm_s + allreduce_s                   (nothing overlapped)
    predicted   = max_s time_s
    step        = pipedream: predicted;  2bw: M * predicted;
                  1f1b, gpipe: (M + S - 1) * max_s (compute_s / r_s + comm_s) + max_s ring_s
    (ring_s = the stage's whole ring all-reduce, allreduce_s * u_s)

cut_s is the bytes of the tensors produced before stage s and used at or after it (a skip
connection is charged at every boundary it crosses), sent forward as activations and back as
gradients, and charged to the stage after the boundary. Memory per device of stage s:

    weights + extra weight versions + in_flight_s * activation_bytes_s
    in_flight: 1f1b, 2bw: min(S - s, M); gpipe: M; pipedream: w_s + 1,
               w_s = floor((sum_{t >= s} r_t - 1) / r_s)
    extra versions: pipedream w_s copies of the parameters (stashed); 2bw one copy; else none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdcompile.cluster import Cluster
from pdcompile.cost_graph import CostGraph
from pdcompile.errors import PartitionError
from pdcompile.plans import Plan, Stage, check_schedule


@dataclass(frozen=True)
class NodeSums:
    """What a set of nodes costs: compute split in forward/backward, and memory parts."""

    forward_s: float
    backward_s: float
    grad_bytes: int
    weight_bytes: int  # parameters + gradients + optimizer state
    param_bytes: int
    activation_bytes: int

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s


def node_sums(cost_graph: CostGraph, nodes: Sequence[str]) -> NodeSums:
    """Sums over `nodes`; data-source (kind "input") nodes have no compute."""
    attrs = [cost_graph.graph.nodes[n] for n in nodes]
    compute = [a for a in attrs if a["kind"] != "input"]
    return NodeSums(
        forward_s=math.fsum(a["forward_s"] for a in compute),
        backward_s=math.fsum(a["backward_s"] for a in compute),
        grad_bytes=sum(a["grad_bytes"] for a in attrs),
        weight_bytes=sum(a["param_bytes"] + a["grad_bytes"] + a["optimizer_bytes"] for a in attrs),
        param_bytes=sum(a["param_bytes"] for a in attrs),
        activation_bytes=sum(a["activation_bytes"] for a in attrs),
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


def allreduce_time(grad_bytes: float, replicas: int, bandwidth: float) -> float:
    """Ring all-reduce of `grad_bytes` among `replicas` devices."""
    return 2 * (replicas - 1) / replicas * grad_bytes / bandwidth if replicas > 1 else 0.0


def updates_every(schedule: str, replicas: int, num_microbatches: int) -> int:
    """Minibatches per all-reduce of a stage's gradients."""
    return replicas if schedule == "pipedream" else num_microbatches


def in_flight(schedule: str, stage: int, replicas: Sequence[int], num_microbatches: int) -> int:
    """Microbatches whose activations a replica of `stage` keeps at once."""
    num_stages = len(replicas)
    if schedule == "gpipe":
        return num_microbatches
    if schedule == "pipedream":
        return warmup(stage, replicas) + 1
    return min(num_stages - stage, num_microbatches)


def warmup(stage: int, replicas: Sequence[int]) -> int:
    """PipeDream's warm-up forwards of `stage`: floor((sum_{t >= s} r_t - 1) / r_s)."""
    return (sum(replicas[stage:]) - 1) // replicas[stage]


def extra_weight_versions(schedule: str, stage: int, replicas: Sequence[int]) -> int:
    if schedule == "pipedream":
        return warmup(stage, replicas)
    return 1 if schedule == "2bw" else 0


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
    if len(set(used)) != len(used) or any(not 0 <= r < cluster.num_devices for r in used):
        raise PartitionError(
            f"the plan's ranks {used} are not distinct ranks of a cluster of "
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


def evaluate(
    plan: Plan,
    cost_graph: CostGraph,
    cluster: Cluster | None = None,
    schedule: str | None = None,
    num_microbatches: int | None = None,
) -> Plan:
    """Re-score any plan with pdcompile's cost model (the yardstick for comparing solvers).

    Args:
        plan: stages (nodes, ranks) from any solver.
        cost_graph: the costs the plan is scored on.
        cluster, schedule, num_microbatches: override the plan's.

    Returns:
        A copy of `plan` with every stage's times and memory and the plan's predictions filled in.

    Raises:
        PartitionError: the plan does not fit the graph or the cluster.
    """
    cluster = cluster or plan.cluster
    schedule = check_schedule(schedule or plan.schedule)
    m = num_microbatches or plan.num_microbatches
    stage_of = check_plan(plan, cost_graph, cluster)
    count = len(plan.stages)
    cuts = cut_bytes(cost_graph, stage_of, count)
    pairs = pair_bytes(cost_graph, stage_of)
    replicas = [s.replicas for s in plan.stages]
    stages, compute_parts, allreduces = [], [], []
    tensors, ties = parameter_layout(cost_graph, stage_of)
    for s in plan.stages:
        sums = node_sums(cost_graph, s.nodes)
        speed = cluster.device_speed(s.ranks)
        compute = sums.compute_s / speed
        comm = 0.0
        if s.index > 0:
            prev = plan.stages[s.index - 1].ranks
            bandwidth = cluster.bandwidth(min(prev[0], s.ranks[0]), max(prev[-1], s.ranks[-1]))
            comm = 2 * cuts[s.index] / bandwidth / s.replicas
        every = updates_every(schedule, s.replicas, m)
        ring = allreduce_time(
            sums.grad_bytes, s.replicas, cluster.bandwidth(s.ranks[0], s.ranks[-1])
        )
        versions = extra_weight_versions(schedule, s.index, replicas)
        memory = (
            sums.weight_bytes
            + versions * sums.param_bytes
            + in_flight(schedule, s.index, replicas, m) * sums.activation_bytes
        )
        compute_parts.append(compute / s.replicas + comm)
        allreduces.append(ring)
        stages.append(
            Stage(
                index=s.index, nodes=s.nodes, replicas=s.replicas, ranks=s.ranks,
                forward_s=sums.forward_s / speed, backward_s=sums.backward_s / speed,
                comm_s=comm, allreduce_s=ring / every, memory_bytes=memory,
                time_s=compute / s.replicas + comm + ring / every,
                recv_bytes=tuple((a, b) for (a, d), b in sorted(pairs.items()) if d == s.index),
                activation_bytes=sums.activation_bytes, param_bytes=sums.param_bytes,
                grad_bytes=sums.grad_bytes, weight_bytes=sums.weight_bytes,
                param_tensors=tensors[s.index],
            )
        )  # fmt: skip
    predicted = max(s.time_s for s in stages)
    if schedule == "pipedream":
        step = predicted
    elif schedule == "2bw":
        step = m * predicted
    else:
        step = (m + count - 1) * max(compute_parts) + max(allreduces)
    total = node_sums(cost_graph, cost_graph.nodes)
    speeds = cluster.speed or (1.0,) * cluster.num_devices
    bound = total.compute_s / math.fsum(speeds)
    everyone = cluster.num_devices
    dp_time = total.compute_s / min(speeds) / everyone + allreduce_time(
        total.grad_bytes, everyone, cluster.bandwidth(0, everyone - 1)
    ) / updates_every(schedule, everyone, m)
    fits = cluster.memory is None or all(s.memory_bytes <= cluster.memory for s in stages)
    return plan.with_(
        stages=tuple(stages), cluster=cluster, schedule=schedule, num_microbatches=m,
        predicted_time=predicted, step_time=step, lower_bound=bound,
        gap=predicted / bound - 1 if bound > 0 else 0.0, data_parallel_time=dp_time,
        fits_memory=fits, ties=ties,
    )  # fmt: skip
