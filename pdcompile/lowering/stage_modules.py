"""Assembling a stage module: leaf modules, parameters and buffers under their original names.

Shared by code generation and by `StagedProgram.load`. A stage shares its leaf modules and
tensors with the captured graph (and so with the model), except the tensors of tie groups it does
not own: it holds copies of those, and a leaf module holding one is deep-copied with only that
tensor replaced, so moving one stage to a device never moves another stage's tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.graph import CodeGen, _PyTreeCodeGen, _PyTreeInfo
from torch.utils._pytree import TreeSpec


class TreeOutputCodeGen(_PyTreeCodeGen):
    """Plain inputs and the captured graph's output structure (e.g. a `ModelOutput`).

    The last stage of an exported graph takes its inputs by name like every stage, and returns
    `pytree.tree_unflatten([...], self._out_spec)`, as the captured graph does.
    """

    def __init__(self, out_spec: TreeSpec) -> None:
        super().__init__(_PyTreeInfo([], None, out_spec))  # type: ignore[arg-type]

    def process_inputs(self, *args: Any) -> Any:
        return args

    def gen_fn_def(
        self, free_vars: list[str], maybe_return_annotation: str, *, expanded_def: bool = False
    ) -> str:
        return CodeGen.gen_fn_def(
            self, free_vars, maybe_return_annotation, expanded_def=expanded_def
        )


def fetch(module: nn.Module, path: str) -> Any:
    """The attribute at a dotted path, or None."""
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def _owner(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    """The module that holds `path`'s last part (created empty where missing), and that part."""
    *prefix, field = path.split(".")
    owner = root
    for part in prefix:
        child = getattr(owner, part, None)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    return owner, field


def install(root: nn.Module, path: str, value: Any) -> None:
    """Set `value` at a dotted path, creating empty modules on the way."""
    owner, field = _owner(root, path)
    setattr(owner, field, value)


def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tie group's copy: same values, its own storage and gradient."""
    data = tensor.detach().clone()
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(data, requires_grad=tensor.requires_grad)
    return data


def rebound(module: nn.Module, replace: Mapping[int, torch.Tensor]) -> nn.Module:
    """`module` itself, or a deep copy whose tensors listed in `replace` (by id) are swapped."""
    tensors = [t for _, t in module.named_parameters(remove_duplicate=False)]
    tensors += [t for _, t in module.named_buffers(remove_duplicate=False)]
    if not any(id(t) in replace for t in tensors):
        return module
    memo: dict[int, Any] = {id(t): replace.get(id(t), t) for t in tensors}
    return copy.deepcopy(module, memo)


def assemble_root(
    graph: fx.Graph, lookup: Callable[[str], Any], replace: Mapping[int, torch.Tensor]
) -> nn.Module:
    """A module holding what `graph`'s `call_module` and `get_attr` nodes name.

    `lookup(target)` gives the original object; tensors listed in `replace` are swapped for
    their copies. A `get_attr` below a leaf module of the stage is left to that module.
    """
    root = nn.Module()
    leaves = sorted({n.target for n in graph.nodes if n.op == "call_module"})
    for target in leaves:
        install(root, target, rebound(lookup(target), replace))
    for node in graph.find_nodes(op="get_attr"):
        if any(node.target.startswith(f"{leaf}.") for leaf in leaves):
            continue
        value = lookup(node.target)
        if isinstance(value, torch.Tensor):
            value = replace.get(id(value), value)
        install(root, node.target, value)
    return root


def finish_state(
    stage: nn.Module,
    held: Iterable[tuple[tuple[str, ...], torch.Tensor]],
    non_persistent: set[str],
) -> None:
    """Give `stage` every name of every tensor it holds, with the original buffer persistence.

    fx copies only the names its graph uses and registers every copied buffer as persistent;
    tied tensors need all their names for the state dict to be complete. Buffers that are not
    among `held` are constants the graph made: kept non-persistent, out of the state dict.
    """
    names: set[str] = set()
    for group, tensor in held:
        for name in group:
            names.add(name)
            if fetch(stage, name) is None:
                owner, field = _owner(stage, name)
                if isinstance(tensor, nn.Parameter):
                    owner.register_parameter(field, tensor)
                else:
                    owner.register_buffer(field, tensor, persistent=name not in non_persistent)
    for name, _ in stage.named_buffers(remove_duplicate=False):
        owner, field = _owner(stage, name)
        persistent = name in names and name not in non_persistent
        if persistent == (field in owner._non_persistent_buffers_set):
            # only modules created for the stage get here: a leaf module shared with the model
            # already has the model's persistence
            if persistent:
                owner._non_persistent_buffers_set.discard(field)
            else:
                owner._non_persistent_buffers_set.add(field)


def non_persistent(module: nn.Module) -> set[str]:
    """Qualified names of the buffers `module` keeps out of its state dict."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules(remove_duplicate=False)
        for name in sub._non_persistent_buffers_set
    }
