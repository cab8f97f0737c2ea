"""Fold the calibrated per-operation framework cost (`framework_cost`) into every node's times.

**Counting.** Each compute node runs once alone (`node_runner.NodeCall`, on the values of a full
forward pass). Its forward runs under a `TorchDispatchMode` that counts the ATen operations
reaching the kernels: a Linear is `t` and `addmm` (2), a ReLU 2 (`relu`, and the `detach`
autograd makes of the output it saves), a view 1; a composite operator counts as what it
decomposes into. Its backward nodes are counted on the autograd graph its outputs hold, walked
back to its inputs: every node it created (not the inputs' own history, not the leaves'
`AccumulateGrad`), plus one `AccumulateGrad` per trainable parameter tensor the node owns (its
first user, as the memory pass charges parameters), which the whole backward runs once; the
operations those nodes run are counted by the same mode around `torch.autograd.grad` of the
node alone (an `AccumulateGrad` runs one). A split backward's parts count the nodes on a path to
the activation inputs (I) and to the weights (W, with the `AccumulateGrad`s) and the operations
of a grad call to each: a Linear's `AddmmBackward0` is in both, so I + W may exceed the fused
count, as their measured times may. A node's framework seconds are
`nodes * backward_node_s + operations * backward_op_s` backward, `operations * forward_op_s`
forward.

**Folding, analytic costs** (`profile=False`): the roofline's fixed `overhead_s` per direction is
replaced by the node's framework seconds:
`time = max(flops / peak, bytes / bandwidth) + framework`.

**Folding, profiled costs**: the profile already holds every operation's framework cost, so
adding it again would count it twice. The forward is timed in place, node by node, with autograd
on: each node's time includes its dispatch, recording and allocation, and stays as measured.
The backward's total is the whole graph's backward measured in context, which includes every
node's engine cost; what the profile lacks is its attribution: the total is shared out in
proportion to each node's backward timed alone less the fixed cost of a `torch.autograd.grad`
call, so a node whose backward is mostly framework gets little or nothing and large nodes absorb
the rest. The fold carves the framework share out of that same total:

    backward_i = framework_i * q + compute_i * s
    compute_i  = max(alone_i - isolated_i, 0)

where `framework_i` is the node's framework seconds in context, `isolated_i` those of its
isolated backward less one node of one operation (no `AccumulateGrad`; the subtracted grad
call's calibration, a view, ran one node of one operation), `alone_i` its isolated time less
the grad call (the profile's `backward_s` over its in-context scale), and `s` the factor that
makes the sum the measured whole again. `q` is 1, unless the counted
framework cost exceeds the whole backward measured (then `q` < 1 scales it down to fit and the
compute shares are 0) or no node has compute left (then `q` > 1 spreads the whole by counts). The
split parts are carved the same way with their own counts and `s`. Totals stay the measured
ones; only the shares between nodes move, which is what cutting the graph into stages needs.

Reads `pdcompile.measured_s`, `pdcompile.measured_split_s` and `gm.meta["pdcompile.profile"]`
(its `whole_s` and `backward_scale`), or `pdcompile.analytic_s`, `pdcompile.analytic_split_s` and
`gm.meta["pdcompile.device_model"]`; `gm.meta["pdcompile.param_table"]`. Writes
`pdcompile.framework_ops` (`OperationCounts`), `pdcompile.framework_s` (the framework share of
forward, backward, I, W) and `pdcompile.folded_s` (the four folded times, what the CostGraph
takes) on every node, and `gm.meta["pdcompile.framework"]` (`FrameworkFold`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from pdcompile.core.ir import (
    ANALYTIC_S,
    ANALYTIC_SPLIT_S,
    DEVICE_MODEL,
    FOLDED_S,
    FRAMEWORK,
    FRAMEWORK_OPS,
    FRAMEWORK_S,
    MEASURED_S,
    MEASURED_SPLIT_S,
    PARAM_TABLE,
    PROFILE,
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

if TYPE_CHECKING:
    from pdcompile.passes.framework_cost import FrameworkCost

Times = tuple[float, float, float, float]  # forward, backward, backward_input, backward_weight


@dataclass(frozen=True)
class OperationCounts:
    """What a node runs: ATen operations forward; autograd nodes of its fused backward and of a
    split backward's two parts, and the ATen operations each runs (`*_ops`); `accumulate`, the
    `AccumulateGrad`s of the parameter tensors it owns, one node and one operation each,
    included in the fused backward's and W's counts."""

    forward: int = 0
    backward: int = 0
    backward_input: int = 0
    backward_weight: int = 0
    accumulate: int = 0
    backward_ops: int = 0
    backward_input_ops: int = 0
    backward_weight_ops: int = 0


@dataclass(frozen=True)
class FrameworkFold:
    """How a graph's times took the framework cost: the calibration, `"profile"` (carved out of
    the measured backward) or `"analytic"` (added, replacing the roofline's overhead), the scale
    `q` of the carved framework share (1: it fitted), and the framework seconds in the
    forward and backward totals."""

    cost: FrameworkCost
    mode: str
    scale: float
    forward_s: float
    backward_s: float

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cost": self.cost.to_dict()}


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_forward(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(ATen operations `fn` dispatches to kernels, its result)."""
    with _Counter() as counter:
        result = fn()
    return counter.ops, result


def count_backward(
    outputs: Sequence[torch.Tensor],
    stop: Collection[int],
    activations: Collection[int],
    weights: Collection[int],
) -> tuple[int, int, int]:
    """Autograd nodes between `outputs` and their leaves: (all, those with a path to a leaf in
    `activations`, those with a path to one in `weights`), leaves by `id`. `AccumulateGrad`
    and the nodes whose `id` is in `stop` (the inputs' own history) are walked, not counted."""
    reach: dict[int, tuple[Any, frozenset[str]]] = {}  # id -> (node kept alive, kinds reached)
    # depth first without recursion: a leaf module's graph may be thousands of nodes deep
    stack = [(out.grad_fn, False) for out in outputs if out.grad_fn is not None]
    while stack:
        fn, expanded = stack.pop()
        if id(fn) in reach:
            continue
        nexts = [nxt for nxt, _ in fn.next_functions if nxt is not None]
        if type(fn).__name__ == "AccumulateGrad":
            leaf = id(fn.variable)
            reach[id(fn)] = (fn, frozenset({"a"} if leaf in activations else
                                           {"w"} if leaf in weights else ()))  # fmt: skip
        elif expanded:
            reach[id(fn)] = (fn, frozenset().union(*(reach[id(n)][1] for n in nexts)))
        else:
            stack.append((fn, True))
            stack.extend((n, False) for n in nexts if id(n) not in reach)
    counted = [
        kinds
        for key, (fn, kinds) in reach.items()
        if key not in stop and type(fn).__name__ != "AccumulateGrad"
    ]
    return len(counted), sum("a" in k for k in counted), sum("w" in k for k in counted)


def count_grad_ops(outputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> int:
    """ATen operations `torch.autograd.grad(outputs, targets)` runs (the output gradients, ones,
    made beforehand; the graph retained)."""
    grads = [torch.ones_like(t) for t in outputs]
    with _Counter() as counter:
        torch.autograd.grad(outputs, targets, grads, retain_graph=True, allow_unused=True)
    return counter.ops


def count_node(call: NodeCall, accumulate: int = 0) -> OperationCounts:
    """Count one node's operations (module docstring); `accumulate`: parameter tensors it owns."""
    args, kwargs, activations, weights = call.split_inputs()
    given = [t for _, t in iter_tensors((args, kwargs))]
    stop = {id(t.grad_fn) for t in given if t.grad_fn is not None}
    with torch.enable_grad():
        forward, out = count_forward(lambda: call.forward(args, kwargs))
    outputs = differentiable_outputs(out)
    a = accumulate
    if not (outputs and (activations or weights)):
        return OperationCounts(forward, a, 0, a, a, a, 0, a)
    ids = {id(t) for t in activations}, {id(t) for t in weights}
    total, to_input, to_weight = count_backward(outputs, stop, *ids)
    ops = count_grad_ops(outputs, activations + weights)
    input_ops = count_grad_ops(outputs, activations) if activations and weights else 0
    weight_ops = count_grad_ops(outputs, weights) if activations and weights else 0
    if not (activations and weights):  # one kind: the whole backward is that part
        input_ops, weight_ops = (ops, 0) if activations else (0, ops)
    return OperationCounts(
        forward, total + a, to_input, to_weight + a, a, ops + a, input_ops, weight_ops + a
    )


def owned_parameters(gm: fx.GraphModule) -> dict[str, int]:
    """Trainable parameter tensors per owning node (the first user)."""
    owned: dict[str, int] = {}
    for info in gm.meta.get(PARAM_TABLE, ()):
        if not info.is_buffer and info.requires_grad and info.users:
            owned[info.users[0]] = owned.get(info.users[0], 0) + 1
    return owned


def annotate_framework(
    gm: fx.GraphModule,
    inputs: Mapping[str, torch.Tensor],
    cost: FrameworkCost,
    *,
    measured: bool,
) -> fx.GraphModule:
    """Count every node's operations and fold `cost` into its times (module docstring):
    carved out of the profile's backward when `measured`, else added to the analytic times."""
    values = record_values(gm, inputs)
    weights = weight_nodes(gm)
    owned = owned_parameters(gm)
    counts: dict[str, OperationCounts] = {}
    with preserved_state(gm):
        for node in gm.graph.nodes:
            counts[node.name] = OperationCounts()
            if node.op in COMPUTE_OPS:
                call = NodeCall(gm, node, values, weights)
                counts[node.name] = count_node(call, owned.get(node.name, 0))
    del values
    if measured:
        settings = gm.meta[PROFILE]
        times = {n.name: (*n.meta[MEASURED_S], *n.meta[MEASURED_SPLIT_S]) for n in gm.graph.nodes}
        folded, share, scale = fold_profiled(
            times, counts, cost, settings.whole_s[1], settings.backward_scale
        )
    else:
        overhead = gm.meta[DEVICE_MODEL].overhead_s
        times = {n.name: (*n.meta[ANALYTIC_S], *n.meta[ANALYTIC_SPLIT_S]) for n in gm.graph.nodes}
        folded, share = fold_analytic(times, counts, cost, overhead)
        scale = 1.0
    for node in gm.graph.nodes:
        node.meta[FRAMEWORK_OPS] = counts[node.name]
        node.meta[FRAMEWORK_S] = share[node.name]
        node.meta[FOLDED_S] = folded[node.name]
    gm.meta[FRAMEWORK] = FrameworkFold(
        cost,
        "profile" if measured else "analytic",
        scale,
        math.fsum(s[0] for s in share.values()),
        math.fsum(s[1] for s in share.values()),
    )
    return gm


def _framework(c: OperationCounts, cost: FrameworkCost, q: float = 1.0) -> Times:
    """Forward, backward, I and W framework seconds of `c` (the backward's times `q`)."""
    node, op = cost.backward_node_s * q, cost.backward_op_s * q
    return (
        c.forward * cost.forward_op_s,
        c.backward * node + c.backward_ops * op,
        c.backward_input * node + c.backward_input_ops * op,
        c.backward_weight * node + c.backward_weight_ops * op,
    )


def _isolated(c: OperationCounts, cost: FrameworkCost) -> tuple[float, float, float]:
    """The framework seconds of the backward, I and W run alone, less what the subtracted grad
    call's calibration (a view: one node of one operation) already took off; none of them runs
    the `AccumulateGrad`s."""
    node, op, a = cost.backward_node_s, cost.backward_op_s, c.accumulate
    parts = ((c.backward - a, c.backward_ops - a), (c.backward_input, c.backward_input_ops),
             (c.backward_weight - a, c.backward_weight_ops - a))  # fmt: skip
    return tuple(max(n - 1, 0) * node + max(o - 1, 0) * op for n, o in parts)


def fold_analytic(
    times: Mapping[str, Times],
    counts: Mapping[str, OperationCounts],
    cost: FrameworkCost,
    overhead_s: float,
) -> tuple[dict[str, Times], dict[str, Times]]:
    """(folded times, framework shares): each time priced (above 0) loses the roofline's
    `overhead_s` and gains its count times the calibrated cost."""
    folded, share = {}, {}
    for name, t in times.items():
        part = _framework(counts[name], cost)
        folded[name] = tuple(
            max(x - overhead_s, 0.0) + p if x > 0 else p for x, p in zip(t, part, strict=True)
        )
        share[name] = part
    return folded, share


def fold_profiled(
    times: Mapping[str, Times],
    counts: Mapping[str, OperationCounts],
    cost: FrameworkCost,
    whole_backward_s: float,
    backward_scale: float,
) -> tuple[dict[str, Times], dict[str, Times], float]:
    """(folded times, framework shares, q): the backward's framework share carved out of the
    measured whole (module docstring); forwards unchanged. The folded backwards sum to
    `whole_backward_s` (the profile's sum) whenever some node has a backward count."""
    compute: dict[str, tuple[float, float, float]] = {}
    for name, (_, b, i, w) in times.items():
        isolated = _isolated(counts[name], cost)
        compute[name] = tuple(
            max((x / backward_scale if backward_scale > 0 else 0.0) - f, 0.0)
            for x, f in zip((b, i, w), isolated, strict=True)
        )
    framework = math.fsum(_framework(n, cost)[1] for n in counts.values())
    work = math.fsum(p[0] for p in compute.values())
    rest = whole_backward_s - framework
    if framework > 0 and (rest < 0 or work <= 0):
        q, s = whole_backward_s / framework, 0.0
    else:
        q, s = 1.0, (rest / work if work > 0 else 0.0)
    folded, share = {}, {}
    for name, t in times.items():
        part = _framework(counts[name], cost, q)
        share[name] = part
        folded[name] = (t[0], *(p + x * s for p, x in zip(part[1:], compute[name], strict=True)))
    return folded, share, q
