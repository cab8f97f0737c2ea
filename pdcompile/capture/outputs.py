"""The structure of what a model returns, kept by the captured graph.

torch.export flattens outputs with pytree and rebuilds them from the graph's `out_spec`; fx
symbolic tracing rebuilds a dict subclass (a Hugging Face `ModelOutput`) as a plain `dict`, so
its graph gets a node that builds the subclass again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from pdcompile.graph.state import preserved_state


def model_output(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Run `model` once (no grad, state restored) and register its dataclass outputs as pytrees,
    so their structure can be flattened and rebuilt."""
    with preserved_state(model), torch.no_grad():
        output = model(*args, **kwargs)
    pending = [output]
    while pending:
        value = pending.pop()
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if type(value) not in pytree.SUPPORTED_NODES:
                torch.export.register_dataclass(type(value))
            pending.extend(getattr(value, f.name) for f in dataclasses.fields(value))
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (tuple, list)):
            pending.extend(value)
    return output


def keep_output_structure(gm: fx.GraphModule, output: Any) -> None:
    """Make a symbolically traced `gm` return `output`'s dict subclasses (a `ModelOutput`, not
    the plain dict fx rebuilds): a node calling the class on the traced dict is added before
    the output, so fields that are None at run time are dropped as the model drops them."""
    node = gm.graph.output_node()
    with gm.graph.inserting_before(node):
        rebuilt = _rebuild(gm.graph, node.args[0], output)
    if rebuilt is not node.args[0]:
        node.args = (rebuilt,)
        gm.recompile()


def _rebuild(graph: fx.Graph, traced: Any, real: Any) -> Any:
    if isinstance(traced, dict) and isinstance(real, dict):
        items = {k: _rebuild(graph, v, real.get(k)) for k, v in traced.items()}
        if type(real) is dict:
            return items if any(items[k] is not traced[k] for k in items) else traced
        return graph.call_function(type(real), (), items)
    if isinstance(traced, (tuple, list)) and isinstance(real, (tuple, list)):
        if len(traced) != len(real):
            return traced
        items = [_rebuild(graph, t, r) for t, r in zip(traced, real, strict=True)]
        changed = any(a is not b for a, b in zip(items, traced, strict=True))
        return type(traced)(items) if changed else traced
    return traced


def returns_dict(gm: fx.GraphModule) -> bool:
    """Whether the graph's output holds a dict (possibly rebuilt from a dict subclass)."""
    pending = [gm.graph.output_node().args[0]]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            return True
        if isinstance(value, (tuple, list)):
            pending.extend(value)
    return False
