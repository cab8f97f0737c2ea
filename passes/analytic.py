"""Analytic costs: FLOPs, bytes moved and roofline time of every node's forward and backward.

FLOPs come from `torch.utils.flop_counter.FlopCounterMode` around the node's forward and around
its backward (run with `torch.autograd.grad` on the node alone), with `flop_rules`' formulas for
the attention kernels torch does not count and the grouped-convolution backward it overcounts.
The counter knows matmul-, convolution- and attention-like operators only, so elementwise and
normalisation nodes count zero FLOPs and are priced by the bytes they move. Bytes moved are read
off tensor metadata: forward reads the inputs and parameters and writes the outputs; backward is
charged twice that (it reads the output gradients, saved inputs and weights, and writes input
and weight gradients). Everything runs on the tensors' device, `meta` included, so models too
big for this machine can be priced for hardware it does not have.

The split backward is priced the same way: the input-gradient part I (`torch.autograd.grad` to
the node's activation inputs only) and the weight-gradient part W (to its weights only) are
counted apart, each charged the forward's bytes once (I reads the output gradients and the
weights and writes the input gradients; W reads the output gradients and the saved inputs and
writes the weight gradients) and its own per-operation overhead. A node with only one kind
(no parameters; or no differentiable input, like an embedding) has all of its backward in it.

Reads `pdcompile.outputs`. Writes `pdcompile.flops`, `pdcompile.bytes_moved` and
`pdcompile.analytic_s` (each a `(forward, backward)` pair), `pdcompile.split_flops` and
`pdcompile.analytic_split_s` (each a `(backward_input, backward_weight)` pair) on every node,
and `gm.meta["pdcompile.device_model"]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx

from pdcompile.core.ir import (
    ANALYTIC_S,
    ANALYTIC_SPLIT_S,
    BYTES_MOVED,
    DEVICE_MODEL,
    FLOPS,
    OUTPUT_BYTES,
    SPLIT_FLOPS,
    iter_tensors,
)
from pdcompile.graph.node_runner import (
    COMPUTE_OPS,
    NodeCall,
    differentiable_outputs,
    record_values,
    weight_nodes,
)
from pdcompile.graph.state import preserved_state
from pdcompile.passes.device_model import DeviceModel
from pdcompile.passes.flop_rules import flop_counter

Pair = tuple[float, float]


@dataclass(frozen=True)
class _Costs:
    """One node's counts: (forward, backward) FLOPs and bytes moved, and the split backward's
    (input, weight) FLOPs and bytes moved."""

    flops: Pair = (0.0, 0.0)
    moved: Pair = (0.0, 0.0)
    split_flops: Pair = (0.0, 0.0)
    split_moved: Pair = (0.0, 0.0)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def annotate_analytic(
    gm: fx.GraphModule, inputs: Mapping[str, torch.Tensor], device_model: str | DeviceModel
) -> fx.GraphModule:
    """Write FLOPs, bytes moved and roofline seconds on every node of `gm`."""
    model = DeviceModel.get(device_model)
    values = record_values(gm, inputs)
    weights = weight_nodes(gm)

    def seconds(flops: float, moved: float) -> float:
        return model.time(flops, moved) if moved else 0.0

    with preserved_state(gm):
        for node in gm.graph.nodes:
            costs = _Costs()
            if node.op in COMPUTE_OPS:
                call = NodeCall(gm, node, values, weights)
                costs = _node_costs(call, node.meta[OUTPUT_BYTES])
            node.meta[FLOPS] = costs.flops
            node.meta[BYTES_MOVED] = costs.moved
            node.meta[SPLIT_FLOPS] = costs.split_flops
            forward_s = (
                model.time(costs.flops[0], costs.moved[0]) if node.op in COMPUTE_OPS else 0.0
            )
            node.meta[ANALYTIC_S] = (forward_s, seconds(costs.flops[1], costs.moved[1]))
            node.meta[ANALYTIC_SPLIT_S] = tuple(
                seconds(f, b) for f, b in zip(costs.split_flops, costs.split_moved, strict=True)
            )
    gm.meta[DEVICE_MODEL] = model
    return gm


def _node_costs(call: NodeCall, output_bytes: int) -> _Costs:
    args, kwargs, activations, weights = call.split_inputs()
    read = _nbytes([t for _, t in iter_tensors((args, kwargs))])
    if call.module is not None:
        read += _nbytes([*call.module.parameters(), *call.module.buffers()])
    moved = float(read + output_bytes)
    with torch.enable_grad(), flop_counter() as forward:
        out = call.forward(args, kwargs)
    grads_from = differentiable_outputs(out)
    if not grads_from or not (activations or weights):
        return _Costs((float(forward.get_total_flops()), 0.0), (moved, 0.0))
    grads = [torch.ones_like(t) for t in grads_from]

    def backward_flops(targets: list[torch.Tensor]) -> float:
        with flop_counter() as counter:
            torch.autograd.grad(grads_from, targets, grads, retain_graph=True, allow_unused=True)
        return float(counter.get_total_flops())

    flops = (float(forward.get_total_flops()), backward_flops(activations + weights))
    if activations and weights:
        split = (backward_flops(activations), backward_flops(weights))
        split_moved = (moved, moved)
    else:  # one kind: the whole backward is that part
        split = (flops[1], 0.0) if activations else (0.0, flops[1])
        split_moved = (2 * moved, 0.0) if activations else (0.0, 2 * moved)
    return _Costs(flops, (moved, 2 * moved), split, split_moved)
