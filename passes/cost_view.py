"""Derive the torch-free CostGraph from an annotated graph (one way: never written back).

Reads `pdcompile.scope`, `pdcompile.output_bytes`, the memory keys, `pdcompile.optimizer_s`,
`pdcompile.accumulate_s`,
`pdcompile.flops`,
`pdcompile.analytic_s` and `pdcompile.measured_s` (the node times come from one or the other;
the split backward's from `pdcompile.analytic_split_s` or `pdcompile.measured_split_s`; all four
from `pdcompile.folded_s` where the framework cost was folded in), `pdcompile.measured_spread`,
and `gm.meta["pdcompile.param_table"]` for the CostGraph's `meta["param_tensors"]` and
`meta["ties"]` (docs/simulator.md) and for which edges carry gradients (`pdcompile.outputs`'
dtypes too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.fx as fx

from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.ir import (
    ACCUMULATE_S,
    ACTIVATION_BYTES,
    ANALYTIC_S,
    ANALYTIC_SPLIT_S,
    FLOPS,
    FOLDED_S,
    GRAD_BYTES,
    MEASURED_S,
    MEASURED_SPLIT_S,
    MEASURED_SPREAD,
    OPTIMIZER_BYTES,
    OPTIMIZER_S,
    OUTPUT_BYTES,
    OUTPUTS,
    PARAM_BYTES,
    PARAM_TABLE,
    WEIGHT_GRAD_ACTIVATION_BYTES,
    module_path,
    target_name,
)

_KIND = {"placeholder": "input", "output": "output"}


Times = tuple[float, float, float, float]  # forward, backward, backward_input, backward_weight


def node_times(gm: fx.GraphModule, *, measured: bool) -> dict[str, Times]:
    """Every node's four times as the CostGraph takes them: folded (`pdcompile.folded_s`)
    where the framework cost was, else profiled when `measured`, else analytic."""
    times, split = (MEASURED_S, MEASURED_SPLIT_S) if measured else (ANALYTIC_S, ANALYTIC_SPLIT_S)
    out = {}
    for node in gm.graph.nodes:
        if FOLDED_S in node.meta:  # the calibrated framework cost folded in (framework_fold)
            out[node.name] = tuple(float(t) for t in node.meta[FOLDED_S])
        else:
            out[node.name] = tuple(float(t) for t in (*node.meta[times], *node.meta[split]))
    return out


def to_cost_graph(
    gm: fx.GraphModule,
    batch_size: int,
    meta: dict[str, Any],
    *,
    measured: bool,
    rows: Sequence[int] = (),
    row_s: Mapping[str, Any] | None = None,
) -> CostGraph:
    """One CostGraph node per graph node (same names, same order), one edge per data dependency.

    Times (with the split backward's parts) are the profiled ones when `measured`, else the
    analytic ones (`node_times`); `rows` and `row_s` (node -> its times at each of `rows`) are
    the graph's and nodes' times at several row counts (`analyze`). `meta` gains
    `param_tensors` (node -> parameter tensors it owns, as `param_bytes` counts them) and `ties`
    (per parameter with gradients that several nodes use: `{"nodes": [...], "grad_bytes": n}`).
    """
    graph = CostGraph(batch_size=batch_size, meta={**meta, **parameter_layout(gm)}, rows=rows)
    times = node_times(gm, measured=measured)
    for node in gm.graph.nodes:
        forward_s, backward_s, backward_input_s, backward_weight_s = times[node.name]
        forward_spread, backward_spread = node.meta.get(MEASURED_SPREAD, (0.0, 0.0))
        flops_forward, flops_backward = node.meta[FLOPS]
        graph.add_node(
            node.name,
            kind=_KIND.get(node.op, "compute"),
            forward_s=float(forward_s),
            backward_s=float(backward_s),
            backward_input_s=float(backward_input_s),
            backward_weight_s=float(backward_weight_s),
            optimizer_s=float(node.meta.get(OPTIMIZER_S, 0.0)),
            accumulate_s=float(node.meta.get(ACCUMULATE_S, 0.0)),
            forward_spread=float(forward_spread) if measured else 0.0,
            backward_spread=float(backward_spread) if measured else 0.0,
            param_bytes=node.meta[PARAM_BYTES],
            grad_bytes=node.meta[GRAD_BYTES],
            optimizer_bytes=node.meta[OPTIMIZER_BYTES],
            activation_bytes=node.meta[ACTIVATION_BYTES],
            weight_grad_activation_bytes=node.meta[WEIGHT_GRAD_ACTIVATION_BYTES],
            output_bytes=node.meta[OUTPUT_BYTES],
            flops_forward=float(flops_forward),
            flops_backward=float(flops_backward),
            description=f"{node.op}: {target_name(node)}",
            scope=module_path(node),
            row_s=(row_s or {}).get(node.name),
        )
    flows = gradient_flow(gm)
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            graph.add_edge(arg.name, node.name, arg.meta[OUTPUT_BYTES], flows[arg.name])
    return graph


def gradient_flow(gm: fx.GraphModule) -> dict[str, bool]:
    """Per node, whether a gradient flows back into its output: it holds a floating tensor
    computed from a trainable parameter (directly or through nodes that are). Inputs are data:
    integer ids, masks and values computed from the inputs alone carry none, as at run time
    (code generation's channels only require grad where autograd tracks the value)."""
    trained = {
        user
        for info in gm.meta.get(PARAM_TABLE, ())
        if not info.is_buffer and info.requires_grad
        for user in info.users
    }
    flows: dict[str, bool] = {}
    for node in gm.graph.nodes:
        floating = any("float" in s.dtype or "complex" in s.dtype for s in node.meta[OUTPUTS])
        fed = node.name in trained or any(flows[a.name] for a in node.all_input_nodes)
        flows[node.name] = floating and fed
    return flows


def parameter_layout(gm: fx.GraphModule) -> dict[str, Any]:
    """What the runtime's per-tensor work and tie all-reduces need to know of the parameters: how
    many tensors each node owns (its first user, as the memory pass charges them) and which
    nodes share a tensor with gradients."""
    tensors: dict[str, int] = {}
    ties = []
    for info in gm.meta.get(PARAM_TABLE, ()):
        if info.is_buffer or not info.users:
            continue
        tensors[info.users[0]] = tensors.get(info.users[0], 0) + 1
        users = list(dict.fromkeys(info.users))
        if len(users) > 1 and info.requires_grad:
            ties.append({"nodes": users, "grad_bytes": info.nbytes})
    return {"param_tensors": tensors, "ties": ties}
