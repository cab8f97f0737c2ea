"""Memory: parameters, gradients and optimizer state each node owns, activations it keeps.

A parameter used by several nodes (tied) is owned by its first user, so sums over nodes count it
once. Optimizer state is a multiple of the trainable parameter bytes: none for SGD, one copy
(momentum buffer) for SGD with momentum, two (first and second moments) for Adam, which also
keeps a step count per tensor (a float32 scalar, `STEP_BYTES`).

Activations kept for the backward pass are measured, not guessed: one forward pass with autograd
on runs under `torch.autograd.graph.saved_tensors_hooks`, and every tensor autograd saves is
charged to the node running at that moment. A storage saved twice (by a producer and by a
consumer) is charged once, to the first node that saves it; parameters and buffers are not
activations. Works on the `meta` device. With `autocast` (the dtype `compile(autocast=)` runs
forwards in) the forward runs under `torch.autocast`, so what it saves is measured at the dtypes
the run saves: bf16/fp16 activations, the lower-precision copies of the weights a matrix product
saves for its backward (one per microbatch in flight), fp32 where autocast keeps it (a layer
norm, a softmax); the weights themselves, their gradients and optimizer state stay fp32.

Of those, the storages some node's weight gradient reads stay alive after the input-gradient
part I of a split backward, until its weight-gradient part W: a Linear's input, a LayerNorm's
input and statistics (`weight_grad_reads`). They are charged, like the activations, to the node
they are charged to (so a node's share is at most its `activation_bytes`).

With a loss function and targets, what the loss saves for its backward on the model's output (a
cross-entropy's log-softmax, the size of the logits) is charged to the `output` node: the last
stage keeps it for every microbatch in flight, as it keeps its nodes' activations. It is freed
by the input-gradient part I of a split backward (autograd runs it first), so it is not in
`weight_grad_activation_bytes`.

Reads `pdcompile.params`, `pdcompile.param_table`. Writes on every node `pdcompile.param_bytes`,
`pdcompile.grad_bytes`, `pdcompile.optimizer_bytes`, `pdcompile.buffer_bytes`,
`pdcompile.activation_bytes`, `pdcompile.weight_grad_activation_bytes` (ints), and
`gm.meta["pdcompile.optimizer"]`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from pdcompile.core.errors import CostError
from pdcompile.core.ir import (
    ACTIVATION_BYTES,
    BUFFER_BYTES,
    GRAD_BYTES,
    OPTIMIZER,
    OPTIMIZER_BYTES,
    PARAM_BYTES,
    WEIGHT_GRAD_ACTIVATION_BYTES,
    param_table,
)
from pdcompile.graph.node_runner import COMPUTE_OPS, NodeCall, weight_nodes
from pdcompile.graph.state import preserved_state
from pdcompile.passes.weight_grad import weight_grad_reads

# Optimizer state bytes per byte of trainable parameter.
OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 2}
STEP_BYTES = {"adam": 4}  # per trainable tensor: Adam's step count, a float32 scalar tensor


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def annotate_memory(
    gm: fx.GraphModule,
    inputs: Mapping[str, torch.Tensor],
    optimizer: str = "sgd",
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    targets: Any = None,
    autocast: torch.dtype | None = None,
) -> fx.GraphModule:
    """Write the memory keys on every node of `gm`, measuring activations on `inputs` (and,
    with `loss_fn` and `targets` for the example's rows, what the loss saves, on the `output`
    node), under `torch.autocast` to `autocast` where given (a CPU or CUDA graph).

    Raises:
        CostError: an unknown optimizer kind.
    """
    if optimizer not in OPTIMIZER_STATE:
        raise CostError(f"optimizer must be one of {sorted(OPTIMIZER_STATE)}, got {optimizer!r}")
    _annotate_weights(gm, optimizer)
    recorder = _SaveRecorder(gm)
    args = [compact(inputs[p.target]) for p in gm.graph.find_nodes(op="placeholder")]
    precision = _precision(gm, args, autocast)
    with preserved_state(gm), torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), precision():
            output = recorder.run(*args)
        with precision():  # each node alone, as in the run
            kept = _kept_for_weight_grads(gm, recorder.values, recorder.saved_by)
        if loss_fn is not None and targets is not None:
            (out,) = gm.graph.find_nodes(op="output")
            loss = _loss_bytes(output, loss_fn, compact(targets), recorder.state, recorder.charged)
            out.meta[ACTIVATION_BYTES] += loss
    for node in gm.graph.nodes:
        node.meta[WEIGHT_GRAD_ACTIVATION_BYTES] = 0
    for key in kept - recorder.state:
        if key in recorder.charged:
            node, nbytes = recorder.charged[key]
            node.meta[WEIGHT_GRAD_ACTIVATION_BYTES] += nbytes
    return gm


def compact(value: Any) -> Any:
    """`value` with each tensor copied into a storage of its own size: autograd's saves are
    charged by storage, and an example that is a view of a larger tensor (`x[:16]` of a
    dataset) would charge every microbatch the whole of it."""

    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() <= t.nbytes:
            return t
        return t.detach().clone().requires_grad_(t.requires_grad)

    return pytree.tree_map(copy, value)


def _annotate_weights(gm: fx.GraphModule, optimizer: str) -> None:
    """Write each node's parameter, gradient, optimizer-state and buffer bytes (a tied
    parameter owned by its first user), a zero activation count, and `gm`'s optimizer kind."""
    owned: dict[str, list] = {}
    for info in param_table(gm).values():
        if info.users:
            owned.setdefault(info.users[0], []).append(info)
    for node in gm.graph.nodes:
        infos = owned.get(node.name, [])
        trained = [p for p in infos if not p.is_buffer and p.requires_grad]
        trainable = sum(p.nbytes for p in trained)
        node.meta[PARAM_BYTES] = sum(p.nbytes for p in infos if not p.is_buffer)
        node.meta[GRAD_BYTES] = trainable
        steps = STEP_BYTES.get(optimizer, 0) * len(trained)
        node.meta[OPTIMIZER_BYTES] = OPTIMIZER_STATE[optimizer] * trainable + steps
        node.meta[BUFFER_BYTES] = sum(p.nbytes for p in infos if p.is_buffer)
        node.meta[ACTIVATION_BYTES] = 0
    gm.meta[OPTIMIZER] = optimizer


class _SaveRecorder(fx.Interpreter):
    """Runs `gm` node by node, keeping each node's value; `pack` (a saved-tensor hook) charges
    every storage autograd saves to the node running, once, unless it is a parameter's or a
    buffer's."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.state = {_storage_key(t) for t in [*gm.parameters(), *gm.buffers()]}
        self.charged: dict[int, tuple[fx.Node, int]] = {}  # storage -> (node charged, bytes)
        self.saved_by: dict[str, list[int]] = {}  # node -> storages of what it saves, in order
        self.values: dict[str, Any] = {}  # node -> its value, to run nodes alone afterwards
        self._current: list[fx.Node] = []

    def run_node(self, n: fx.Node) -> Any:
        self._current.append(n)
        try:
            self.values[n.name] = result = super().run_node(n)
            return result
        finally:
            self._current.pop()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """The saved-tensor hook: record `tensor`'s storage against the running node."""
        key, current = _storage_key(tensor), self._current
        if current:
            self.saved_by.setdefault(current[-1].name, []).append(key)
        if current and key not in self.state and key not in self.charged:
            self.charged[key] = (current[-1], tensor.untyped_storage().nbytes())
            current[-1].meta[ACTIVATION_BYTES] += self.charged[key][1]
        return tensor


def _precision(
    gm: fx.GraphModule, args: list[Any], autocast: torch.dtype | None
) -> Callable[[], AbstractContextManager]:
    """A factory of the context the forwards run in: `torch.autocast` to `autocast` on the
    device of the first input or parameter where given and that device is CPU or CUDA, else
    none."""
    device = next((t.device.type for t in [*args, *gm.parameters()]
                   if isinstance(t, torch.Tensor)), "cpu")  # fmt: skip
    lower = autocast is not None and device in ("cpu", "cuda")

    def precision() -> Any:
        return torch.autocast(device, dtype=autocast) if lower else nullcontext()

    return precision


def _kept_for_weight_grads(
    gm: fx.GraphModule, values: dict[str, Any], saved_by: dict[str, list[int]]
) -> set[int]:
    """The storages (of those the whole run saved) that some node's weight gradient reads:
    each node is run alone and its saves matched to the whole run's by their order."""
    weights = weight_nodes(gm)
    kept: set[int] = set()
    for node in gm.graph.nodes:
        keys = saved_by.get(node.name, [])
        if node.op not in COMPUTE_OPS or not keys:
            continue
        count, reads = weight_grad_reads(NodeCall(gm, node, values, weights))
        if reads and count != len(keys):  # alone it saves other tensors: W keeps them all
            kept.update(keys)
        else:
            kept.update(keys[i] for i in reads)
    return kept


def _loss_bytes(
    output: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    targets: Any,
    state: set[int],
    charged: dict[int, Any],
) -> int:
    """Bytes of the storages `loss_fn(output, targets)` saves that the graph did not save
    already (the output is detached into leaves, as the last stage's outputs are tensors its
    graph produced). A loss that fails here is left to the loss pass, which reports it."""
    device = next((t.device for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)),
                  None)  # fmt: skip

    def leaf(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.detach().requires_grad_(True)
        return t

    def moved(t: Any) -> Any:
        return t.to(device) if isinstance(t, torch.Tensor) and device is not None else t

    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in state and key not in charged:
            seen.setdefault(key, tensor.untyped_storage().nbytes())
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_fn(pytree.tree_map(leaf, output), pytree.tree_map(moved, targets))
    except Exception:
        return 0
    return sum(seen.values())
