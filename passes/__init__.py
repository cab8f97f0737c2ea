"""Analysis and partitioning passes over the captured graph (installed as `pdcompile.passes`).

Each analysis pass is a function `annotate_x(gm, ...) -> gm` that writes documented `node.meta`
keys (see `pdcompile.core.ir` and docs/architecture.md) and never changes what the graph computes.
Passes over the torch-free CostGraph (coarsening, the solvers) import without torch, so this
package imports its members lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "annotate_scope": "pdcompile.graph.scope",
    "annotate_shapes": "pdcompile.graph.shapes",
    "annotate_params": "pdcompile.graph.params",
    "annotate_memory": "pdcompile.passes.memory",
    "annotate_analytic": "pdcompile.passes.analytic",
    "annotate_profile": "pdcompile.passes.profile",
    "to_cost_graph": "pdcompile.passes.cost_view",
    "coarsen": "pdcompile.passes.coarsening",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pdcompile.passes' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
