"""Analysis and partitioning passes over the captured GraphModule (installed as `pdcompile.passes`).

Each pass is a function `annotate_x(gm, ...) -> gm` that writes documented `node.meta` keys
(see `pdcompile.ir` and docs/architecture.md) and never changes what the graph computes.
"""

from pdcompile.passes.params import annotate_params
from pdcompile.passes.scope import annotate_scope
from pdcompile.passes.shapes import annotate_shapes

__all__ = ["annotate_params", "annotate_scope", "annotate_shapes"]
