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

Reads `pdcompile.outputs`. Writes `pdcompile.flops`, `pdcompile.bytes_moved` and
`pdcompile.analytic_s` (each a `(forward, backward)` pair) on every node, and
`gm.meta["pdcompile.device_model"]`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx

from pdcompile.ir import ANALYTIC_S, BYTES_MOVED, DEVICE_MODEL, FLOPS, OUTPUT_BYTES, iter_tensors
from pdcompile.passes.device_model import DeviceModel
from pdcompile.passes.flop_rules import flop_counter
from pdcompile.passes.node_runner import (
    COMPUTE_OPS,
    NodeCall,
    differentiable_outputs,
    record_values,
)
from pdcompile.passes.state import preserved_state


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def annotate_analytic(
    gm: fx.GraphModule, inputs: Mapping[str, torch.Tensor], device_model: str | DeviceModel
) -> fx.GraphModule:
    """Write FLOPs, bytes moved and roofline seconds on every node of `gm`."""
    model = DeviceModel.get(device_model)
    values = record_values(gm, inputs)
    with preserved_state(gm):
        for node in gm.graph.nodes:
            flops, moved, seconds = (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)
            if node.op in COMPUTE_OPS:
                flops, moved = _node_costs(NodeCall(gm, node, values), node.meta[OUTPUT_BYTES])
                backward_s = model.time(flops[1], moved[1]) if moved[1] else 0.0
                seconds = (model.time(flops[0], moved[0]), backward_s)
            node.meta[FLOPS] = flops
            node.meta[BYTES_MOVED] = moved
            node.meta[ANALYTIC_S] = seconds
    gm.meta[DEVICE_MODEL] = model
    return gm


def _node_costs(
    call: NodeCall, output_bytes: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    args, kwargs, targets = call.inputs()
    read = _nbytes([t for _, t in iter_tensors((args, kwargs))])
    if call.module is not None:
        read += _nbytes([*call.module.parameters(), *call.module.buffers()])
    with torch.enable_grad(), flop_counter() as forward:
        out = call.forward(args, kwargs)
    grads_from = differentiable_outputs(out)
    if not grads_from or not targets:
        return (float(forward.get_total_flops()), 0.0), (float(read + output_bytes), 0.0)
    with flop_counter() as backward:
        torch.autograd.grad(
            grads_from, targets, [torch.ones_like(t) for t in grads_from], allow_unused=True
        )
    moved = float(read + output_bytes)
    return (float(forward.get_total_flops()), float(backward.get_total_flops())), (moved, 2 * moved)
