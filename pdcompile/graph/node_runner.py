"""Run the nodes of a captured graph one at a time, as the cost passes need.

`record_values` runs the whole graph once (autograd on, model state restored) and keeps every
node's value. `NodeCall` then re-runs one node on those values, with the inputs that required
grad in the real run made fresh leaves that require grad, so the node's backward can be run and
timed in isolation, whole or split: the gradients of its inputs (the input-gradient part I of a
split backward) apart from those of its weights (W): the parameters of its module and the
arguments computed from parameters alone (`weight_nodes`: a `get_attr` weight, its transpose).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.node import map_arg

from pdcompile.core.errors import CostError
from pdcompile.core.ir import iter_tensors
from pdcompile.graph.mutation import is_inplace
from pdcompile.graph.state import preserved_state

COMPUTE_OPS = ("call_module", "call_function", "call_method")


def record_values(gm: fx.GraphModule, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Every node's value in one forward pass with autograd on (node name -> value)."""
    values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n.name] = result = super().run_node(n)
            return result

    args = [inputs[p.target] for p in gm.graph.find_nodes(op="placeholder")]
    with preserved_state(gm), torch.enable_grad():
        Recorder(gm).run(*args)
    return values


def weight_nodes(gm: fx.GraphModule) -> frozenset[str]:
    """The nodes whose value is computed from parameters and buffers alone (`get_attr` nodes and
    the nodes all of whose inputs are such): a gradient reaching them is a weight gradient, which
    a split backward defers to W. Graph inputs and whatever they reach are activations."""
    found: set[str] = set()
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "get_attr" or (
            node.op in COMPUTE_OPS and inputs and all(n.name in found for n in inputs)
        ):
            found.add(node.name)
    return frozenset(found)


class _Fresh:
    """Copies arguments so an in-place node cannot corrupt the recorded values; the copies of
    tensors that required grad in the real run are leaves requiring grad (passed behind a clone
    when the node writes into its input), sorted into activations and weights (the values whose
    ids are in `weight_ids`)."""

    def __init__(self, inplace: bool, weight_ids: set[int]) -> None:
        self.inplace = inplace
        self.weight_ids = weight_ids
        self.leaves: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        fresh = value.detach().clone()
        if not (value.requires_grad and fresh.is_floating_point()):
            return fresh
        fresh.requires_grad_()
        (self.weights if id(value) in self.weight_ids else self.leaves).append(fresh)
        return fresh.clone() if self.inplace else fresh


class NodeCall:
    """One compute node, runnable on the values `record_values` recorded."""

    def __init__(
        self,
        gm: fx.GraphModule,
        node: fx.Node,
        values: Mapping[str, Any],
        weights: Collection[str] | None = None,
    ) -> None:
        """`weights`: `weight_nodes(gm)`, when the caller runs many nodes (else computed)."""
        if node.op not in COMPUTE_OPS:
            raise CostError(f"node {node.name} ({node.op}) computes nothing: it cannot be run")
        self.node = node
        self.module = gm.get_submodule(node.target) if node.op == "call_module" else None
        self.args, self.kwargs = map_arg((node.args, node.kwargs), lambda n: values[n.name])
        weights = weight_nodes(gm) if weights is None else weights
        self.weight_ids = {
            id(t)
            for n in node.all_input_nodes
            if n.name in weights
            for _, t in iter_tensors(values[n.name])
        }

    def inputs(self) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]:
        """Fresh copies of the node's arguments, and the leaves its backward differentiates."""
        args, kwargs, activations, weights = self.split_inputs()
        return args, kwargs, activations + weights

    def split_inputs(
        self,
    ) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor], list[torch.Tensor]]:
        """Fresh copies of the node's arguments, and the leaves its backward differentiates in
        two lists: activations (the input-gradient part I) and weights (W: its module's
        parameters and its arguments computed from weights alone)."""
        fresh = _Fresh(is_inplace(self.node, self.module), self.weight_ids)
        args, kwargs = pytree.tree_map(fresh, (self.args, self.kwargs))  # keeps container types
        params = [p for p in self.module.parameters() if p.requires_grad] if self.module else []
        return args, kwargs, fresh.leaves, fresh.weights + params

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return invoke(self.node, self.module, args, kwargs)


def invoke(node: fx.Node, module: torch.nn.Module | None, args: tuple, kwargs: dict) -> Any:
    """Do what a compute node does, on the given arguments (`module` for `call_module` nodes)."""
    if module is not None:
        return module(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def differentiable_outputs(output: Any) -> list[torch.Tensor]:
    """The output tensors that carry gradient (those a backward pass starts from)."""
    return [t for _, t in iter_tensors(output) if t.requires_grad and t.grad_fn is not None]
