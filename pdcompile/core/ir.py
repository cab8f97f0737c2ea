"""The IR: a `torch.fx.GraphModule` whose `node.meta` and `gm.meta` carry namespaced values.

Passes write the keys below and tools read them back; docs/architecture.md has the full table.
Values are frozen dataclasses, tuples and strings, because fx copies `meta` shallowly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from pdcompile.core.errors import TraceError

# node.meta keys
SCOPE = "pdcompile.scope"  # tuple[(qualified name, module type), ...], outermost module first
OUTPUTS = "pdcompile.outputs"  # tuple[TensorSpec, ...]: every tensor in the node's output value
OUTPUT_BYTES = "pdcompile.output_bytes"  # int: sum of OUTPUTS' bytes
PARAMS = "pdcompile.params"  # tuple[str, ...]: canonical names of parameters/buffers it uses
PARAM_BYTES = "pdcompile.param_bytes"  # int: parameters the node owns (a tied one: its first user)
GRAD_BYTES = "pdcompile.grad_bytes"  # int: gradients of the trainable parameters it owns
OPTIMIZER_BYTES = "pdcompile.optimizer_bytes"  # int: optimizer state of those parameters
OPTIMIZER_S = "pdcompile.optimizer_s"  # float: one optimizer step over those parameters
# float: a backward adding those parameters' gradients to the ones they hold (per microbatch)
ACCUMULATE_S = "pdcompile.accumulate_s"
BUFFER_BYTES = "pdcompile.buffer_bytes"  # int: buffers the node owns
ACTIVATION_BYTES = "pdcompile.activation_bytes"  # int: tensors autograd keeps for its backward
# int: of ACTIVATION_BYTES, the storages some node's weight gradient reads (kept until W)
WEIGHT_GRAD_ACTIVATION_BYTES = "pdcompile.weight_grad_activation_bytes"
FLOPS = (
    "pdcompile.flops"  # (forward, backward): floating-point operations, torch.utils.flop_counter
)
BYTES_MOVED = "pdcompile.bytes_moved"  # (forward, backward): bytes read and written
ANALYTIC_S = "pdcompile.analytic_s"  # (forward, backward): roofline seconds on the device model
MEASURED_S = "pdcompile.measured_s"  # (forward, backward): profiled seconds, medians
# The split backward, each an (input gradients I, weight gradients W) pair:
SPLIT_FLOPS = "pdcompile.split_flops"  # FLOPs of the two parts
ANALYTIC_SPLIT_S = "pdcompile.analytic_split_s"  # roofline seconds of the two parts
MEASURED_SPLIT_S = "pdcompile.measured_split_s"  # profiled seconds of the two parts, medians
# (forward, backward): relative spread of the profiled repeats, (p75 - p25) / median
MEASURED_SPREAD = "pdcompile.measured_spread"
# The calibrated per-operation framework cost (passes/framework_fold.py):
FRAMEWORK_OPS = "pdcompile.framework_ops"  # OperationCounts: ATen ops forward, autograd nodes
FRAMEWORK_S = "pdcompile.framework_s"  # (forward, backward, I, W): their framework seconds
FOLDED_S = "pdcompile.folded_s"  # (forward, backward, I, W): the times with the fold applied

# gm.meta keys
CAPTURE = "pdcompile.capture"  # "fx" or "export": the path that produced the graph
TRAINING = "pdcompile.training"  # bool: the model's mode when it was captured
INPUTS = "pdcompile.inputs"  # tuple[str, ...]: names of the graph's tensor inputs, in call order
# tuple[(input name, dim or None), ...]: inputs whose batch is not dim 0 (None: no batch
# dimension, every microbatch gets the whole tensor); the others are batch-major
BATCH_DIMS = "pdcompile.batch_dims"
CONSTANTS = "pdcompile.constants"  # tuple[(argument, repr of value), ...] bound into the graph
AUTO_LEAVES = "pdcompile.auto_leaves"  # tuple[(qualified name, reason), ...]
PARAM_TABLE = "pdcompile.param_table"  # tuple[ParamInfo, ...], one per distinct tensor
OPTIMIZER = "pdcompile.optimizer"  # "sgd" | "momentum" | "adam": what OPTIMIZER_BYTES assumes
OPTIMIZER_PRICED = "pdcompile.optimizer_priced"  # str: the optimizer OPTIMIZER_S timed
OPTIMIZER_CALL_S = "pdcompile.optimizer_call_s"  # float: its fixed cost per step() call
LOSS_S = "pdcompile.loss_s"  # (forward, backward) seconds of the loss per batch, or None
DEVICE_MODEL = "pdcompile.device_model"  # DeviceModel behind ANALYTIC_S
PROFILE = "pdcompile.profile"  # ProfileSettings behind MEASURED_S
FRAMEWORK = "pdcompile.framework"  # FrameworkFold behind FOLDED_S


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and size of one tensor a node produces."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(
            tuple(tensor.shape), dtype_name(tensor.dtype), tensor.numel() * tensor.element_size()
        )

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class ParamInfo:
    """One parameter or buffer tensor of the original model.

    `names` holds every fully qualified name under which the model exposes the tensor (several
    when parameters are tied, e.g. a GPT's embedding and LM head); `names[0]` is canonical.
    `users` are the graph nodes that use it (none for a tensor the forward pass never touches).
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    is_buffer: bool
    requires_grad: bool
    users: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`."""
    return str(dtype).removeprefix("torch.")


def iter_tensors(value: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(path, tensor)` for every tensor inside nested tuples, lists, dicts and dataclasses.

    Dict-like outputs (including Hugging Face `ModelOutput`) are walked in insertion order;
    `None` fields are skipped, like `ModelOutput.to_tuple()` does.
    """
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from iter_tensors(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from iter_tensors(item, f"{path}[{i}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            yield from iter_tensors(item, f"{path}.{field.name}" if path else field.name)


def param_table(gm: fx.GraphModule) -> dict[str, ParamInfo]:
    """The parameter ownership table of a captured graph, keyed by canonical name."""
    return {p.name: p for p in gm.meta.get(PARAM_TABLE, ())}


def owned_params(gm: fx.GraphModule, node: fx.Node) -> tuple[ParamInfo, ...]:
    """The parameters and buffers `node` uses, from the ownership table."""
    table = param_table(gm)
    return tuple(table[name] for name in node.meta.get(PARAMS, ()))


def module_path(node: fx.Node) -> str:
    """Qualified name of the innermost module `node` was traced in ("" for the root)."""
    scope = node.meta.get(SCOPE, ())
    return scope[-1][0] if scope else ""


def target_name(node: fx.Node) -> str:
    """A short readable name of what the node calls: `torch.cat`, `aten.linear.default`, ..."""
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    name = getattr(target, "__name__", None) or str(target)
    for prefix, namespace in (("torch", torch), ("torch.nn.functional", F)):
        if getattr(namespace, name, None) is target:
            return f"{prefix}.{name}"
    module = getattr(target, "__module__", None) or ""
    if module == "builtins":
        return name
    return f"{module.replace('_operator', 'operator')}.{name}" if module else name


def accept_constants(
    constants: Sequence[tuple[str, str]], kwargs: Mapping[str, Any], owner: str
) -> dict[str, Any]:
    """`kwargs` without the constant arguments bound at capture (`(name, repr(value))` pairs).

    A graph takes the call its model was captured with: a constant may be passed again by
    keyword, with the same value.

    Raises:
        TraceError: a constant is passed with another value.
    """
    bound = dict(constants)
    rest = {}
    for name, value in kwargs.items():
        if name not in bound:
            rest[name] = value
        elif repr(value) != bound[name]:
            raise TraceError(
                f"{owner} was captured with {name}={bound[name]}, and that value is part of the "
                f"graph; it cannot take {name}={value!r}. Call it with {name}={bound[name]} (or "
                f"without {name}), or capture again with example_kwargs={{{name!r}: {value!r}}}"
            )
    return rest


def input_batch_dim(gm: fx.GraphModule, node: fx.Node) -> int | None:
    """The dimension of graph input `node` holding the batch: dim 0 unless `trace(batch_dims=)`
    said otherwise; None for an input without one."""
    specs = node.meta.get(OUTPUTS, ())
    if not specs or not specs[0].shape:
        return None
    return dict(gm.meta.get(BATCH_DIMS, ())).get(node.target, 0)


def graph_batch_size(gm: fx.GraphModule) -> int:
    """Rows of the example batch: the first graph input with a batch dimension (1 if none)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        if (dim := input_batch_dim(gm, node)) is not None:
            return node.meta[OUTPUTS][0].shape[dim]
    return 1
