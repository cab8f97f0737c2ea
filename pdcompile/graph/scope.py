"""Module scope of every node: which (nested) module of the original model it was traced in.

Reads `node.meta["nn_module_stack"]` (written by symbolic tracing and by torch.export).
Writes `node.meta["pdcompile.scope"]`: a tuple of `(qualified name, module type)` pairs from the
outermost module to the innermost, the root excluded. A `call_module` node's scope ends with its
own module; a `get_attr` node takes the scope of its first user.
"""

from __future__ import annotations

import torch.fx as fx

from pdcompile.core.ir import SCOPE


def _type_name(module_type: object) -> str:
    if isinstance(module_type, type):
        return f"{module_type.__module__}.{module_type.__qualname__}"
    return str(module_type)


def _stack_scope(node: fx.Node) -> tuple[tuple[str, str], ...]:
    scope = []
    for qualified_name, module_type in (node.meta.get("nn_module_stack") or {}).values():
        # export names the root "" (or "L__self__") and tags some nodes with a hook's name
        if qualified_name and not qualified_name.startswith(
            ("L__self__", "_empty_nn_module_stack")
        ):
            scope.append((qualified_name, _type_name(module_type)))
    return tuple(scope)


def annotate_scope(gm: fx.GraphModule) -> fx.GraphModule:
    """Write `pdcompile.scope` on every node of `gm`; returns `gm`."""
    for node in gm.graph.nodes:
        scope = _stack_scope(node)
        if node.op == "call_module" and (not scope or scope[-1][0] != node.target):
            module = gm.get_submodule(node.target)
            scope = (*scope, (node.target, _type_name(type(module))))
        node.meta[SCOPE] = scope
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            node.meta[SCOPE] = next(iter(node.users)).meta[SCOPE]
    return gm
