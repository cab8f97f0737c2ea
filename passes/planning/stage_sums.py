"""What a stage's nodes add up to in a CostGraph: times and bytes (`node_sums`; the times at each
profiled row count, `row_sums`), the bytes that
cross its boundaries (`cut_bytes`, `pair_bytes`, `no_grad_pairs`), its parameter tensors and
the tied copies it holds (`parameter_layout`, `tie_copies`), the optimizer's per-call cost, and
what it keeps of its activations (`kept_activations`: with recomputation, and from a split
backward's I to its W, `kept_for_weights`).
What `evaluation.price` prices a stage from. Torch-free.

cut_s is the bytes of the tensors produced before stage s and used at or after it (a skip
connection is charged at every boundary it crosses), sent forward as activations and back as
gradients, and charged to the stage after the boundary.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdcompile.core.cost_attrs import TIME_ATTRS
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError
from pdcompile.core.row_curves import node_points


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
    loss_forward_s: float = 0.0  # the loss function, where the nodes hold the loss node
    loss_backward_s: float = 0.0  # (not in forward_s and backward_s: those are the nodes')
    optimizer_s: float = 0.0  # one optimizer step over the nodes' parameters
    accumulate_s: float = 0.0  # their gradients added to those held, per microbatch

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
        loss_forward_s=loss_forward,
        loss_backward_s=loss_backward,
        optimizer_s=math.fsum(a["optimizer_s"] for a in attrs),
        accumulate_s=math.fsum(a["accumulate_s"] for a in attrs),
    )


def row_sums(cost_graph: CostGraph, nodes: Sequence[str]) -> list[list[float]] | None:
    """At each of the graph's `rows`, what `node_sums` gives of `nodes`' times: `[forward,
    backward, backward_input, backward_weight, loss_forward, loss_backward]` (the loss where
    the nodes hold the `loss_node`), their nodes' curves summed (a node without one counted
    linearly); None for a graph without rows. A sum of such curves is the curve of the sums,
    so a stage's times at any row count read off these points (`evaluation.rescore`)."""
    rows, batch = cost_graph.rows, cost_graph.batch_size
    if not rows or batch is None:
        return None
    g = cost_graph.graph
    points = [cost_graph.node_points(n) for n in nodes if g.nodes[n]["kind"] != "input"]
    loss = cost_graph.loss_node in nodes and cost_graph.loss_s > 0
    loss_points = (
        node_points(rows, batch, cost_graph.loss_row_s,
                    (cost_graph.loss_forward_s, cost_graph.loss_backward_s))
        if loss else ((0.0, 0.0),) * len(rows)
    )  # fmt: skip
    return [
        [*(math.fsum(p[i][k] for p in points) for k in range(len(TIME_ATTRS))), *loss_points[i]]
        for i in range(len(rows))
    ]


def kept_for_weights(cost_graph: CostGraph, nodes: Sequence[str]) -> int:
    """Of a stage's activation bytes, those its split backward's I leaves for W, as the runtime
    keeps them (`runtime/split_backward.py`, docs/memory.md): I keeps the autograd graph from
    the *boundary* down (the nodes holding weights that depend on the stage's inputs; autograd
    keeps everything those reach, so every node before one of them in the stage), and frees
    the rest (the loss, an activation after the last weight). A stage whose inputs carry no
    gradient (the first) has nothing for I: W runs the whole backward and keeps all.

    (What W reads, each node's `weight_grad_activation_bytes`, is less: `torch.autograd`
    frees a graph's saved tensors only as a whole.)"""
    g = cost_graph.graph
    inside = set(nodes)
    tied = {m for tie in cost_graph.meta.get("ties", []) for m in tie.get("nodes", [])}
    reached = [v for u, v, grad in g.edges(data="grad", default=True)
               if v in inside and u not in inside and grad]  # fmt: skip
    if not reached:
        return sum(g.nodes[n]["activation_bytes"] for n in nodes)
    seen = set(reached)
    while reached:  # the nodes depending on the inputs
        for v in g.successors(reached.pop()):
            if v in inside and v not in seen:
                seen.add(v)
                reached.append(v)
    boundary = [n for n in seen if g.nodes[n]["grad_bytes"] > 0
                or tied.intersection(g.nodes[n]["members"])]  # fmt: skip
    kept, queue = set(boundary), list(boundary)
    while queue:  # and what they reach
        for u in g.predecessors(queue.pop()):
            if u in inside and u not in kept:
                kept.add(u)
                queue.append(u)
    return sum(g.nodes[n]["activation_bytes"] for n in kept)


@dataclass(frozen=True)
class Kept:
    """What a stage keeps of its activations (`Stage.activation_bytes`,
    `weight_grad_activation_bytes`, `recompute_bytes`)."""

    in_flight: int  # per microbatch from its forward to its backward (to its I when split)
    for_weights: int  # from a split backward's I to its W
    recomputed: int  # held while its backward (I) runs: the forward run again


def kept_activations(
    cost_graph: CostGraph, nodes: Sequence[str], recompute: bool | Sequence[str], received: int,
    split: bool,
) -> Kept:  # fmt: skip
    """What a stage of `nodes` receiving `received` bytes per microbatch keeps (docs/memory.md),
    as the runtime keeps it (`runtime/recompute.py`). Without recomputation, every activation
    its forward saves. Recomputing (`recompute` True), only its inputs (the checkpoint's), and
    its backward runs the forward again, holding that forward's activations; with segment
    boundaries (node names), also every value a later segment reads (each boundary's output, a
    residual branch's start: each segment's checkpoint keeps its inputs), and the backward holds
    one segment's at a time (the largest counted). Under a split backward (`split`) the
    boundaries make no difference: I runs the forward again, whole, and its graph stays for W
    (`kept_for_weights`)."""
    g = cost_graph.graph
    full = sum(g.nodes[n]["activation_bytes"] for n in nodes)
    for_weights = kept_for_weights(cost_graph, nodes)
    if not recompute:
        return Kept(full, for_weights, 0)
    sources = sum(producer_bytes(cost_graph, n) for n in nodes if g.nodes[n]["kind"] == "input")
    inputs = received + sources
    if recompute is True or split:
        return Kept(inputs, for_weights, full)
    inside, marks = set(nodes), set(recompute)
    order = [n for n in cost_graph.nodes if n in inside]
    position = {n: i for i, n in enumerate(order)}
    cuts = [i for i, n in enumerate(order) if marks.intersection(g.nodes[n]["members"])]
    kept = inputs  # and every value a later segment reads (a boundary, a residual's start)
    for u in order:
        last = max((position[v] for v in g.successors(u) if v in inside), default=-1)
        if any(position[u] <= c < last for c in cuts):
            kept += producer_bytes(cost_graph, u)
    ends = [-1, *cuts, len(order) - 1]
    largest = max(
        sum(g.nodes[n]["activation_bytes"] for n in order[a + 1 : b + 1])
        for a, b in zip(ends, ends[1:], strict=False)
    )
    return Kept(kept, for_weights, largest)


def producer_bytes(cost_graph: CostGraph, node: str) -> int:
    """Bytes a node's output sends across a boundary (once, however many nodes read it)."""
    return max((b for _, _, b in cost_graph.graph.out_edges(node, data="bytes")), default=0)


def edge_bytes(cost_graph: CostGraph, order: list[str]) -> list[int]:
    """Per boundary b = 0..len(order) of `order`, the bytes of the edges across it (from before
    position b to it or after), each edge counted: a bound on the messages a stage from
    boundary j to k receives and sends (`message_buffers.stage_bytes`), which are per pair of
    stages, a tensor sent to each stage that reads it."""
    position = {n: i for i, n in enumerate(order)}
    diff = [0] * (len(order) + 2)
    for u, v, nbytes in cost_graph.graph.edges(data="bytes"):
        if position[u] < position[v]:
            diff[position[u] + 1] += nbytes
            diff[position[v] + 1] -= nbytes
    return list(itertools.accumulate(diff[: len(order) + 1]))


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
