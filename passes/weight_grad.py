"""Which of the tensors a node saves for its backward its weight gradients read.

A split backward runs a node's input gradients (I) at once and its weight gradients (W) later;
what W reads stays alive in between. Autograd unpacks every saved tensor of a backward function
whichever gradients are asked for (a Linear's unpacks its weight, which only the input gradient
needs, and its input, which only the weight gradient needs, together), so the unpacking cannot
tell. It is found by experiment instead: the node runs alone under
`torch.autograd.graph.saved_tensors_hooks`, its weight gradients are taken, then taken again
with one saved tensor replaced by NaNs; if they change, W reads that tensor.
"""

from __future__ import annotations

import torch

from pdcompile.graph.node_runner import NodeCall, differentiable_outputs

__all__ = ["weight_grad_reads"]


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal gradients (a NaN anywhere is a change)."""
    if a is None or b is None:
        return a is b
    return torch.equal(a, b)


def weight_grad_reads(call: NodeCall) -> tuple[int, frozenset[int]]:
    """How many tensors the node saves when run alone, and the positions (in the order it saves
    them) of those its weight gradients read.

    A node without weights: none. A node without activation inputs that need gradients (an
    embedding): all, its whole backward is W. Otherwise each saved tensor is poisoned in turn;
    one that cannot hold NaN (integer indices) or whose poisoning makes the backward fail counts
    as read. Parameters are not tried (they are not activations). On the `meta` device, where no
    values can be compared, W is taken to read the node's activation inputs it saves (a Linear's
    input), nothing else.
    """
    args, kwargs, activations, weights = call.split_inputs()
    saved: list[torch.Tensor] = []
    poison: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> int:
        saved.append(tensor)
        return len(saved) - 1

    def unpack(index: int) -> torch.Tensor:
        return poison.get(index, saved[index])

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        outputs = differentiable_outputs(call.forward(args, kwargs))
    try:
        return _reads(saved, poison, outputs, activations, weights)
    finally:
        # the graph holds `unpack`, which holds `saved`, which may hold the outputs, which hold
        # the graph: a cycle through autograd that Python's collector cannot break
        saved.clear()
        poison.clear()


def _reads(
    saved: list[torch.Tensor],
    poison: dict[int, torch.Tensor],
    outputs: list[torch.Tensor],
    activations: list[torch.Tensor],
    weights: list[torch.Tensor],
) -> tuple[int, frozenset[int]]:
    count = len(saved)
    if not (weights and outputs):
        return count, frozenset()
    if not activations:
        return count, frozenset(range(count))
    if outputs[0].device.type == "meta":
        inputs = {_storage(t) for t in activations}
        return count, frozenset(i for i, t in enumerate(saved) if _storage(t) in inputs)
    grads = [torch.ones_like(t) for t in outputs]

    def weight_grads() -> tuple[torch.Tensor | None, ...]:
        return torch.autograd.grad(outputs, weights, grads, retain_graph=True, allow_unused=True)

    clean = weight_grads()
    params = {_storage(w) for w in weights}
    reads = set()
    for i, tensor in enumerate(saved):
        if _storage(tensor) in params:
            continue
        if not (tensor.is_floating_point() or tensor.is_complex()):
            reads.add(i)
            continue
        poison[i] = torch.full_like(tensor, float("nan"))
        try:
            poisoned = weight_grads()
        except RuntimeError:
            reads.add(i)
        else:
            if not all(_same(a, b) for a, b in zip(poisoned, clean, strict=True)):
                reads.add(i)
        del poison[i]
    return count, frozenset(reads)
