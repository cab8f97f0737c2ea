"""Parameter ownership: which nodes use which parameters and buffers, under their original names.

A `call_module` node owns every parameter and buffer of its module; a `get_attr` node's tensor is
owned by the nodes that consume it. Tied parameters (one tensor under several names, e.g. a GPT's
embedding and LM head) are one entry with every name and every user.

Reads: nothing. Writes `node.meta["pdcompile.params"]` (canonical names, in first-use order) and
`gm.meta["pdcompile.param_table"]` (a `ParamInfo` per distinct tensor, in the module's order).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from pdcompile.core.ir import PARAM_TABLE, PARAMS, ParamInfo, dtype_name


def _named_tensors(module: torch.nn.Module, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    params = module.named_parameters(prefix=prefix, remove_duplicate=False)
    buffers = module.named_buffers(prefix=prefix, remove_duplicate=False)
    return [*params, *buffers]


def annotate_params(gm: fx.GraphModule) -> fx.GraphModule:
    """Attribute every parameter and buffer of `gm` to the nodes that use it; returns `gm`."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in _named_tensors(gm):
        names.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    canonical = {name: group[0] for group in names.values() for name in group}

    users: dict[str, list[str]] = {group[0]: [] for group in names.values()}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            owned = [n for n, _ in _named_tensors(gm.get_submodule(node.target), node.target)]
        else:
            owned = [
                arg.target
                for arg in node.all_input_nodes
                if arg.op == "get_attr" and arg.target in canonical
            ]
        mine = list(dict.fromkeys(canonical[n] for n in owned))
        node.meta[PARAMS] = tuple(mine)
        for name in mine:
            users[name].append(node.name)

    gm.meta[PARAM_TABLE] = tuple(
        ParamInfo(
            names=tuple(group),
            shape=tuple(tensors[key].shape),
            dtype=dtype_name(tensors[key].dtype),
            nbytes=tensors[key].numel() * tensors[key].element_size(),
            is_buffer=not isinstance(tensors[key], torch.nn.Parameter),
            requires_grad=tensors[key].requires_grad,
            users=tuple(users[group[0]]),
        )
        for key, group in names.items()
    )
    return gm
