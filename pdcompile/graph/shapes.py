"""Shape propagation: shape, dtype and bytes of every tensor each node produces.

Runs the graph once on the example inputs (any device, `meta` included) with an `fx.Interpreter`,
without autograd, and leaves the model's state as it found it: buffers (BatchNorm statistics) are
restored and the random number generators are forked.

Reads: nothing. Writes `node.meta["pdcompile.outputs"]` (tuple of `TensorSpec`, one per tensor in
the node's output value, in flattening order; empty for non-tensor values) and
`node.meta["pdcompile.output_bytes"]` (their total bytes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from pdcompile.core.ir import OUTPUT_BYTES, OUTPUTS, TensorSpec, iter_tensors
from pdcompile.graph.state import preserved_state


class _ShapeRecorder(fx.Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        specs = tuple(TensorSpec.of(t) for _, t in iter_tensors(result))
        n.meta[OUTPUTS] = specs
        n.meta[OUTPUT_BYTES] = sum(s.nbytes for s in specs)
        return result


def annotate_shapes(gm: fx.GraphModule, inputs: Mapping[str, torch.Tensor]) -> fx.GraphModule:
    """Record the output tensors of every node of `gm` when it runs on `inputs`.

    Args:
        gm: a captured graph.
        inputs: the graph's tensor inputs by placeholder name (`BoundInputs.tensors`).

    Returns:
        `gm`, annotated.
    """
    args = [inputs[p.target] for p in gm.graph.find_nodes(op="placeholder")]
    with preserved_state(gm), torch.no_grad():
        _ShapeRecorder(gm).run(*args)
    return gm
