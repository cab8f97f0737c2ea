"""What each node's value is, as code generation needs to know to send it between stages.

`describe_values` runs the graph once more, at a second batch size (one row more than the
example's), on synthetic inputs of the recorded shapes and dtypes (random floats, zero integers
and booleans), with autograd on and the model's state left as it was. A dimension whose size
differs from the one `pdcompile.graph.shapes` recorded at the example's batch size scales with
the batch: it becomes the symbol "batch" (or `a*batch+c`, fitted through the two sizes), so a
channel's shape is never guessed from a size that merely equals the batch size. The run also
gives the Python type of every non-tensor value and whether tensors require gradients.

Reads `node.meta["pdcompile.outputs"]` (the shapes at the example's batch size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from pdcompile.core.errors import CodegenError
from pdcompile.core.ir import OUTPUTS, dtype_name, graph_batch_size, input_batch_dim, iter_tensors
from pdcompile.graph.state import preserved_state
from pdcompile.lowering.staged_program import batch_dim

# Values sent between stages as metadata, and those among them that can be written into a
# stage's code as literals (a device is not: every stage has its own).
_LITERALS = (type(None), bool, int, float, str, torch.dtype, torch.layout, torch.memory_format)
_METADATA = (*_LITERALS, torch.device)


@dataclass(frozen=True)
class ValueInfo:
    """One node's value.

    `kind`: "tensor"; "value" (small metadata: None, numbers, strings, dtypes, devices, shapes
    and tuples of them); "container" (a tuple, list or dict holding tensors); "object" (anything
    else, which cannot cross a stage boundary). `constant`: a "value" that no graph input
    influences and that can be written as a literal (`literal`), so it never needs sending.
    """

    kind: str
    shape: tuple[int | str, ...] = ()
    dtype: str = ""
    requires_grad: bool = False
    type_name: str = ""
    constant: bool = False
    literal: Any = None

    def describe(self) -> str:
        if self.kind == "tensor":
            return f"{self.dtype}[{', '.join(map(str, self.shape))}]"
        return self.type_name


def _is_of(value: Any, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_is_of(v, kinds) for v in value)
    return isinstance(value, kinds)


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__name__}"


def _symbolic(
    recorded: tuple[int, ...], observed: tuple[int, ...], batch: int, second: int
) -> tuple[int | str, ...]:
    """Dimensions that changed with the batch size become `a*batch+c` through both points."""
    if len(recorded) != len(observed):
        return tuple(observed)
    dims: list[int | str] = []
    for before, after in zip(recorded, observed, strict=True):
        if before == after:
            dims.append(before)
        else:
            scale = (after - before) // (second - batch)
            dims.append(batch_dim(scale, before - scale * batch))
    return tuple(dims)


def _synthetic_inputs(gm: fx.GraphModule, batch: int, second: int) -> list[torch.Tensor]:
    """Inputs of the recorded shapes with `second` rows where the example had `batch`."""
    tensors = [*gm.parameters(), *gm.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    inputs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        specs = node.meta.get(OUTPUTS)
        if not specs:
            raise CodegenError(
                f"graph input {node.name} has no recorded shape; code generation needs a graph "
                "from pdcompile.trace"
            )
        shape, dim = list(specs[0].shape), input_batch_dim(gm, node)
        if dim is not None and shape[dim] == batch:
            shape[dim] = second
        dtype = getattr(torch, specs[0].dtype)
        if dtype.is_floating_point:
            inputs.append(torch.randn(shape, generator=generator, dtype=dtype).to(device))
        else:  # zeros are valid token ids, class labels and masks
            inputs.append(torch.zeros(shape, dtype=dtype, device=device))
    return inputs


def describe_values(gm: fx.GraphModule) -> dict[str, ValueInfo]:
    """Node name -> `ValueInfo` for every node but the output.

    Raises:
        CodegenError: the graph fails at the second batch size (naming the node), e.g. because
            the model fixes the batch size.
    """
    batch = graph_batch_size(gm)
    second = batch + 1
    influenced: set[str] = set()  # nodes some graph input reaches
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a.name in influenced for a in node.all_input_nodes):
            influenced.add(node.name)
    infos: dict[str, ValueInfo] = {}

    def describe(node: fx.Node, value: Any) -> ValueInfo:
        if isinstance(value, torch.Tensor):
            specs = node.meta.get(OUTPUTS, ())
            recorded = specs[0].shape if specs else tuple(value.shape)
            shape = _symbolic(recorded, tuple(value.shape), batch, second)
            return ValueInfo("tensor", shape, dtype_name(value.dtype), value.requires_grad)
        if _is_of(value, _METADATA):  # torch.Size is a tuple of ints
            constant = node.name not in influenced and _is_of(value, _LITERALS)
            literal = value if constant else None
            return ValueInfo("value", type_name=_type_name(value), constant=constant,
                             literal=literal)  # fmt: skip
        kind = "container" if next(iter_tensors(value), None) is not None else "object"
        return ValueInfo(kind, type_name=_type_name(value))

    class Describer(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            try:
                value = super().run_node(n)
            except Exception as e:
                raise CodegenError(
                    f"node {n.name} fails when the graph runs at batch size {second} (code "
                    f"generation runs it there to find which dimensions are the batch): {e!r}. "
                    "The model must accept any batch size: use x.shape[0], not a number"
                ) from e
            if n.op != "output":
                infos[n.name] = describe(n, value)
            return value

    with preserved_state(gm), torch.enable_grad():
        interpreter = Describer(gm)
        interpreter.extra_traceback = False  # our error names the node already
        interpreter.run(*_synthetic_inputs(gm, batch, second))
    return infos
