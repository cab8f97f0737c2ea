"""Rewrite a symbolically traced graph's in-place operations out of place.

A pipeline stage receives its inputs as fresh leaves (autograd refuses to write into those), a
replica or a stashed weight version must not see another microbatch's writes, and a value sent
to two stages is two copies: an in-place write is only safe when nothing can tell it apart from a
new tensor. So capture turns `relu_(x)` into `relu(x)` and points every later use of `x` at the
result. That is exact unless another value shares `x`'s memory (a view of it, or the tensor it
is a view of) and is used after the write: then the write is visible through that alias, the
rewrite would lose it, and `functionalize` raises `TraceError` naming the node (`trace` then
falls back to torch.export, whose functionalization replays writes through views).

Writes into graph inputs, parameters and buffers are left alone: `trace` refuses a model that
changes its inputs, and buffer updates are state the stage that owns the buffer keeps.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from pdcompile.core.errors import TraceError
from pdcompile.core.ir import iter_tensors
from pdcompile.graph.mutation import (
    AUGMENTED,
    assigned,
    inplace_position,
    target_name,
    written_input,
)


def inplace_nodes(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """`(node, target)` for each node writing into another node's value, in graph order."""
    found = []
    for node in gm.graph.nodes:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        target = written_input(node, module)
        if isinstance(target, fx.Node) and target.op not in ("placeholder", "get_attr"):
            found.append((node, target))
    return found


def functionalize(gm: fx.GraphModule, values: Mapping[str, Any]) -> int:
    """Make every in-place node of `gm` out of place; return how many were rewritten.

    Args:
        gm: a symbolically traced graph (changed in place; its modules stay the user's).
        values: every node's value in one run of the original graph (`record_values`).

    Raises:
        TraceError: a write is visible through an alias used later, or has no out-of-place form.
    """
    found = inplace_nodes(gm)
    if not found:
        return 0
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node, target in found:
        _check_no_alias(node, target, order, values)
    swapped: dict[str, torch.nn.Module] = {}
    for node, _ in found:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        target = written_input(node, module)  # earlier rewrites may have re-pointed it
        _rewrite(gm, node, swapped)
        for user in list(target.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(target, node)
    gm.graph.lint()
    gm.recompile()
    return len(found)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for _, t in iter_tensors(value)]


def _check_no_alias(
    node: fx.Node, target: fx.Node, order: Mapping[fx.Node, int], values: Mapping[str, Any]
) -> None:
    """No value sharing `target`'s memory, other than `target` itself (or earlier in-place
    results, the same tensor), is used after `node` writes into it."""
    same = {id(t) for t in _tensors(values.get(target.name))}
    memory = {id(t._base if t._base is not None else t) for t in _tensors(values.get(target.name))}
    for other, position in order.items():
        tensors = _tensors(values.get(other.name))
        if position >= order[node] or not tensors or {id(t) for t in tensors} <= same:
            continue
        if not {id(t._base if t._base is not None else t) for t in tensors} & memory:
            continue
        later = [u for u in other.users if order[u] > order[node]]
        if later:
            raise TraceError(
                f"node {node.name} writes into {target.name} in place, and {other.name}, which "
                f"shares its memory (a view), is used after the write by {later[0].name}: the "
                "write cannot be rewritten out of place. Use method='export' (it replays writes "
                "through views) or compute a new tensor instead of writing into a view"
            )


def _rewrite(gm: fx.GraphModule, node: fx.Node, swapped: dict[str, torch.nn.Module]) -> None:
    """Point `node` at the out-of-place form of what it calls."""
    if node.op == "call_module":
        if node.target not in swapped:
            module = copy.copy(gm.get_submodule(node.target))  # stateless: `inplace` is a flag
            module.inplace = False
            gm.set_submodule(node.target, module)
            swapped[node.target] = module
        return
    if "inplace" in node.kwargs:
        node.update_kwarg("inplace", False)
        return
    position = inplace_position(node.target) if node.op == "call_function" else None
    if position is not None and len(node.args) > position and node.args[position] is True:
        node.update_arg(position, False)
        return
    twin = _out_of_place(node)
    if twin is None:
        raise TraceError(
            f"node {node.name} ({target_name(node)}) writes into {node.args[0]} in place and "
            "pdcompile knows no out-of-place form of it: use method='export', or write the "
            "model with an out-of-place operation"
        )
    node.target = twin


def _out_of_place(node: fx.Node) -> Any:
    """The out-of-place twin of an in-place method, function or operator, or None."""
    if node.op == "call_function" and node.target in AUGMENTED:
        return AUGMENTED[node.target]
    if node.op == "call_function" and node.target is operator.setitem:
        return assigned
    name = target_name(node).removesuffix("_")
    if node.op == "call_method":
        return name if hasattr(torch.Tensor, name) else None
    if isinstance(node.target, torch._ops.OpOverload):
        packet = getattr(torch.ops.aten, name, None)
        return getattr(packet, node.target._overloadname, None) if packet is not None else None
    module = getattr(node.target, "__module__", None) or ""
    owner = torch if module.startswith("torch") and hasattr(torch, name) else None
    return getattr(owner, name, None) if owner is not None else None
