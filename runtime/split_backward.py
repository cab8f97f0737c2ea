"""A stage's backward in two parts: I (the gradients of its inputs) now, W (those of its
weights) later, without running any part of the backward twice.

`backward_inputs` runs I: it finds, in the microbatch's autograd graph, the *boundary* nodes:
those that depend on the stage's inputs and also feed a weight through nodes that do not (a
`Linear`'s matrix product, a convolution, a layer norm). While autograd walks from the roots
(the loss, or the outputs whose gradients came back) to the inputs, a pre-hook keeps the
gradient arriving at each boundary node. autograd computes only what the inputs need, so a
boundary node computes its input-side gradient and skips its weight-side one (`mm` computes
dX = dY W^T, not dW = X^T dY). The graph is retained, so its saved tensors stay for W.

`SplitBackward.weights` runs W: for each group of weights (weights sharing a boundary node are
one group), `torch.autograd.grad` from the kept gradients at the group's boundary nodes into the
group's weights: autograd runs the boundary nodes again for their weight-side outputs only,
then the weight branches (a transpose, a tied weight's several uses). Roots that do not depend
on the inputs at all (an output computed from weights alone) go wholly into W. Where a boundary
node lies downstream of another of its group, a pre-hook pins its gradient to the one kept, so
nothing is counted twice (torch.distributed.pipelining's `stage_backward_weight` does the same).

A stage whose inputs need no gradient (the first) has nothing for I: W runs the whole backward.
A stage whose graph holds a custom `torch.autograd.Function` at the boundary cannot be split:
its backward computes every gradient in one call, so W would redo the input part. Such a stage
runs its backward fused, in I (`fused_reason` says why), and W has nothing left to do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["SplitBackward", "backward_inputs", "fused_reason"]


def _node(t: torch.Tensor) -> Node | None:
    """The autograd node of `t`: its grad_fn, or for a leaf its gradient accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]  # a leaf's AccumulateGrad


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes whose backward sends gradients to it (the graph's reverse edges)."""
    consumers: dict[Node, list[Node]] = {}
    queue, seen = deque(roots), set(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return consumers


def _upstream(starts: Sequence[Node], consumers: dict[Node, list[Node]]) -> set[Node]:
    """Every node from which autograd reaches one of `starts` (the nodes depending on them in
    the forward), `starts` included."""
    found, queue = set(starts), deque(starts)
    while queue:
        for parent in consumers.get(queue.popleft(), ()):
            if parent not in found:
                found.add(parent)
                queue.append(parent)
    return found


@dataclass(eq=False)
class _Group:
    """Weights whose gradients flow through the same boundary nodes."""

    weights: list[torch.Tensor]
    boundary: list[Node]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass(eq=False)
class SplitBackward:
    """What I kept for W: per group of weights, the gradients at its boundary nodes; the roots
    that do not depend on the inputs (and their gradients); the graph stays alive through
    them until W."""

    groups: list[_Group]
    roots: list[torch.Tensor]
    root_grads: list[torch.Tensor | None]
    leaves: list[torch.Tensor]  # every weight of the stage
    whole: bool = False  # nothing reached the inputs: W runs the whole backward from `roots`

    def weights(self) -> None:
        """Run W: accumulate every weight's gradient into its `.grad`."""
        if self.roots and self.leaves:
            torch.autograd.backward(self.roots, self.root_grads, inputs=self.leaves)
        if self.whole:
            return
        for group in self.groups:
            edges, grads = [], []
            for node in group.boundary:
                for i, grad in enumerate(group.grads.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(grad)
            if not edges:
                continue
            pins = []
            if len(group.boundary) > 1:  # a boundary node downstream of another keeps its own
                for node in group.boundary:
                    kept = group.grads.get(node)
                    if kept is not None:
                        pins.append(node.register_prehook(lambda _, kept=kept: kept))
            try:
                found = torch.autograd.grad(
                    edges, group.weights, grads, retain_graph=True, allow_unused=True
                )
            finally:
                for pin in pins:
                    pin.remove()
            for weight, grad in zip(group.weights, found, strict=True):
                if grad is None:
                    continue
                if weight.grad is None:
                    weight.grad = grad
                else:
                    weight.grad += grad


def fused_reason(roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> str | None:
    """Why this graph cannot be split (a custom autograd Function between the roots and the
    inputs: its backward computes every gradient at once), or None."""
    starts = [n for n in (_node(t) for t in roots) if n is not None]
    consumers = _consumers(starts)
    reach = _upstream([n for n in (_node(t) for t in inputs) if n is not None], consumers)
    for node in reach:
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return (
                f"its graph holds {type(node).__name__}, a custom autograd.Function whose "
                "backward computes input and weight gradients together (no known split)"
            )
    return None


def backward_inputs(
    roots: Sequence[torch.Tensor],
    root_grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], SplitBackward]:
    """Run I: the gradients of `inputs` (None where unused) from `roots` with `root_grads`,
    keeping for W (`SplitBackward.weights`) what it needs to compute the gradients of
    `weights`."""
    leaves = [w for w in weights if w.requires_grad]
    root_nodes = [_node(t) for t in roots]
    starts = [n for n in root_nodes if n is not None]
    consumers = _consumers(starts)
    # used here (or returned as they are: a stage that passes an input on, Dropout(0) alone)
    input_nodes = [n for n in (_node(t) for t in inputs) if n in consumers or n in starts]
    reach = _upstream(input_nodes, consumers) if input_nodes else set()
    if not any(n in reach for n in root_nodes):  # no gradient reaches an input: all for W
        whole = SplitBackward([], list(roots), list(root_grads), leaves, whole=True)
        return tuple(None for _ in inputs), whole
    groups = _groups(leaves, consumers, reach)
    handles = []
    for group in groups:
        for node in group.boundary:

            def keep(grads: tuple[Any, ...], group: _Group = group, node: Node = node) -> None:
                group.grads[node] = tuple(grads)

            handles.append(node.register_prehook(keep))
    tied = [(t, g) for t, n, g in zip(roots, root_nodes, root_grads, strict=True) if n in reach]
    try:
        found = torch.autograd.grad(
            [t for t, _ in tied], list(inputs), [g for _, g in tied],
            retain_graph=True, allow_unused=True,
        )  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()
    free = [(t, g) for t, n, g in zip(roots, root_nodes, root_grads, strict=True)
            if n is not None and n not in reach]  # fmt: skip
    kept = SplitBackward(groups, [t for t, _ in free], [g for _, g in free], leaves)
    return tuple(found), kept


def _groups(
    weights: Sequence[torch.Tensor], consumers: dict[Node, list[Node]], reach: set[Node]
) -> list[_Group]:
    """The weights grouped by the boundary nodes their gradients flow through: walking from a
    weight towards the roots, the first nodes that depend on the inputs."""
    by_boundary: dict[Node, _Group] = {}
    groups: list[_Group] = []
    for weight in weights:
        node = _node(weight)
        if node is None or node not in consumers:
            continue  # not used by this microbatch's graph
        boundary, seen, queue = set(), {node}, deque([node])
        while queue:
            for parent in consumers.get(queue.popleft(), ()):
                if parent in seen:
                    continue
                seen.add(parent)
                if parent in reach:
                    boundary.add(parent)
                else:
                    queue.append(parent)
        if not boundary:
            continue  # reaches only roots independent of the inputs: done from those in W
        merged = {id(by_boundary[b]): by_boundary[b] for b in boundary if b in by_boundary}
        group = _Group([weight], sorted(boundary, key=id))
        for other in merged.values():
            group.weights = other.weights + group.weights
            group.boundary = sorted(set(other.boundary) | set(group.boundary), key=id)
            groups.remove(other)
        for b in group.boundary:
            by_boundary[b] = group
        groups.append(group)
    return groups
