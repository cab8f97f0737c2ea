"""Memory: parameters, gradients and optimizer state each node owns, activations it keeps.

A parameter used by several nodes (tied) is owned by its first user, so sums over nodes count it
once. Optimizer state is a multiple of the trainable parameter bytes: none for SGD, one copy
(momentum buffer) for SGD with momentum, two (first and second moments) for Adam.

Activations kept for the backward pass are measured, not guessed: one forward pass with autograd
on runs under `torch.autograd.graph.saved_tensors_hooks`, and every tensor autograd saves is
charged to the node running at that moment. A storage saved twice (by a producer and by a
consumer) is charged once, to the first node that saves it; parameters and buffers are not
activations. Works on the `meta` device.

Reads `pdcompile.params`, `pdcompile.param_table`. Writes on every node `pdcompile.param_bytes`,
`pdcompile.grad_bytes`, `pdcompile.optimizer_bytes`, `pdcompile.buffer_bytes`,
`pdcompile.activation_bytes` (ints), and `gm.meta["pdcompile.optimizer"]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from pdcompile.errors import CostError
from pdcompile.ir import (
    ACTIVATION_BYTES,
    BUFFER_BYTES,
    GRAD_BYTES,
    OPTIMIZER,
    OPTIMIZER_BYTES,
    PARAM_BYTES,
    param_table,
)
from pdcompile.passes.state import preserved_state

# Optimizer state bytes per byte of trainable parameter.
OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 2}


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def annotate_memory(
    gm: fx.GraphModule, inputs: Mapping[str, torch.Tensor], optimizer: str = "sgd"
) -> fx.GraphModule:
    """Write the memory keys on every node of `gm`, measuring activations on `inputs`.

    Raises:
        CostError: an unknown optimizer kind.
    """
    if optimizer not in OPTIMIZER_STATE:
        raise CostError(f"optimizer must be one of {sorted(OPTIMIZER_STATE)}, got {optimizer!r}")
    owned: dict[str, list] = {}
    for info in param_table(gm).values():
        if info.users:
            owned.setdefault(info.users[0], []).append(info)
    for node in gm.graph.nodes:
        infos = owned.get(node.name, [])
        trainable = sum(p.nbytes for p in infos if not p.is_buffer and p.requires_grad)
        node.meta[PARAM_BYTES] = sum(p.nbytes for p in infos if not p.is_buffer)
        node.meta[GRAD_BYTES] = trainable
        node.meta[OPTIMIZER_BYTES] = OPTIMIZER_STATE[optimizer] * trainable
        node.meta[BUFFER_BYTES] = sum(p.nbytes for p in infos if p.is_buffer)
        node.meta[ACTIVATION_BYTES] = 0
    gm.meta[OPTIMIZER] = optimizer

    state = {_storage_key(t) for t in [*gm.parameters(), *gm.buffers()]}
    charged: set[int] = set()
    current: list[fx.Node] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if current and key not in state and key not in charged:
            charged.add(key)
            current[-1].meta[ACTIVATION_BYTES] += tensor.untyped_storage().nbytes()
        return tensor

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            current.append(n)
            try:
                return super().run_node(n)
            finally:
                current.pop()

    args = [inputs[p.target] for p in gm.graph.find_nodes(op="placeholder")]
    with preserved_state(gm), torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            Recorder(gm).run(*args)
    return gm
