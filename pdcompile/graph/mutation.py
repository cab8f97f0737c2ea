"""Which graph nodes write into a tensor in place, and which argument they write into.

One rule for every phase: capture rewrites these nodes out of place, the cost passes run them on
copies, code generation keeps a write inside the stage that owns its target. A node writes in
place when it is
- a module whose `inplace` attribute is true (`nn.ReLU(inplace=True)`);
- a call with `inplace=True` (`F.relu(x, inplace=True)`, by keyword or by position);
- a method or `torch` function named with a trailing underscore (`x.relu_()`, `torch.relu_(x)`),
  or an augmented assignment or item assignment (`operator.iadd`, `operator.setitem`);
- an ATen operator whose schema marks an argument as written (`aten.div_.Tensor`).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx

AUGMENTED = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod, operator.ipow: operator.pow, operator.iand: operator.and_,
    operator.ior: operator.or_, operator.ixor: operator.xor, operator.ilshift: operator.lshift,
    operator.irshift: operator.rshift, operator.imatmul: operator.matmul,
}  # fmt: skip


def assigned(tensor: torch.Tensor, key: Any, value: Any) -> torch.Tensor:
    """`operator.setitem` out of place: a copy of `tensor` with `copy[key] = value` (autograd
    flows to `tensor` outside `key` and to `value` inside it)."""
    result = tensor.clone()
    result[key] = value
    return result


def target_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def inplace_position(target: Any) -> int | None:
    """Where a function takes its `inplace` flag by position, if it has one."""
    try:
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("inplace") if "inplace" in names else None


def _inplace_flag(node: fx.Node) -> bool:
    if "inplace" in node.kwargs:
        return node.kwargs["inplace"] is True
    if node.op != "call_function" or not callable(node.target):
        return False
    position = inplace_position(node.target)
    return position is not None and len(node.args) > position and node.args[position] is True


def _schema_written(node: fx.Node) -> Any:
    """The argument an ATen operator's schema writes into (not an `out=` argument), or None."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return None
    for position, argument in enumerate(schema.arguments):
        info = argument.alias_info
        if info is None or not info.is_write or argument.kwarg_only:
            continue
        return node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
    return None


def written_input(node: fx.Node, module: torch.nn.Module | None = None) -> Any:
    """The argument `node` writes into in place (usually an `fx.Node`), or None.

    `module` is the submodule a `call_module` node calls.
    """
    if node.op == "call_module":
        return node.args[0] if module is not None and getattr(module, "inplace", False) else None
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    if _inplace_flag(node):
        return node.args[0]
    if node.op == "call_function" and (node.target is operator.setitem or node.target in AUGMENTED):
        return node.args[0]
    if isinstance(node.target, torch._ops.OpOverload):
        return _schema_written(node)
    name = target_name(node)
    if name.endswith("_") and not name.endswith("__") and not name.startswith("_"):
        return node.args[0]
    return None


def is_inplace(node: fx.Node, module: torch.nn.Module | None = None) -> bool:
    """Whether `node` writes into one of its inputs."""
    return written_input(node, module) is not None
