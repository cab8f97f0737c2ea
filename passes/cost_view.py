"""Derive the torch-free CostGraph from an annotated graph (one way: never written back).

Reads `pdcompile.scope`, `pdcompile.output_bytes`, the memory keys, `pdcompile.flops`,
`pdcompile.analytic_s` and `pdcompile.measured_s` (the node times come from one or the other).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from pdcompile.cost_graph import CostGraph
from pdcompile.graph_report import target_name
from pdcompile.ir import (
    ACTIVATION_BYTES,
    ANALYTIC_S,
    FLOPS,
    GRAD_BYTES,
    MEASURED_S,
    OPTIMIZER_BYTES,
    OUTPUT_BYTES,
    PARAM_BYTES,
    module_path,
)

_KIND = {"placeholder": "input", "output": "output"}


def to_cost_graph(
    gm: fx.GraphModule, batch_size: int, meta: dict[str, Any], *, measured: bool
) -> CostGraph:
    """One CostGraph node per graph node (same names, same order), one edge per data dependency.

    Times are the profiled ones when `measured`, else the analytic ones.
    """
    graph = CostGraph(batch_size=batch_size, meta=meta)
    times = MEASURED_S if measured else ANALYTIC_S
    for node in gm.graph.nodes:
        forward_s, backward_s = node.meta[times]
        flops_forward, flops_backward = node.meta[FLOPS]
        graph.add_node(
            node.name,
            kind=_KIND.get(node.op, "compute"),
            forward_s=float(forward_s),
            backward_s=float(backward_s),
            param_bytes=node.meta[PARAM_BYTES],
            grad_bytes=node.meta[GRAD_BYTES],
            optimizer_bytes=node.meta[OPTIMIZER_BYTES],
            activation_bytes=node.meta[ACTIVATION_BYTES],
            output_bytes=node.meta[OUTPUT_BYTES],
            flops_forward=float(flops_forward),
            flops_backward=float(flops_backward),
            description=f"{node.op}: {target_name(node)}",
            scope=module_path(node),
        )
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            graph.add_edge(arg.name, node.name, bytes=arg.meta[OUTPUT_BYTES])
    return graph
