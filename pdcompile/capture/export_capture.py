"""Capture through `torch.export` (non-strict), for models symbolic tracing cannot follow.

The fx graph of `ExportedProgram.module()` is used as the IR: parameters are `get_attr` nodes under
their original names, every node's module path is in `node.meta["nn_module_stack"]`, and the
output structure is restored by the graph's code generator. The batch dimension (dim 0 of every
tensor input) is dynamic, so one graph serves every microbatch size; every other dimension is
fixed, and a call with another size gets a `TraceError` instead of a failed guard.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export import Dim
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from pdcompile.capture.functionalize import functionalize, inplace_nodes
from pdcompile.capture.fx_capture import describe_failure
from pdcompile.capture.graph_module import CapturedGraphModule
from pdcompile.capture.inputs import BoundInputs
from pdcompile.capture.outputs import model_output
from pdcompile.core.errors import TraceError
from pdcompile.graph.mutation import written_input
from pdcompile.graph.node_runner import record_values

# recent torch warns inside its own export (pytree's LeafSpec): nothing a user can act on
LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class ExportedGraphModule(CapturedGraphModule):
    """A graph captured by `torch.export`; calls with another non-batch shape get a `TraceError`."""

    def __init__(
        self,
        root: nn.Module,
        graph: fx.Graph,
        class_name: str,
        training: bool,
        input_specs: dict[str, tuple[tuple[int, ...], torch.dtype, int | None]],
    ) -> None:
        super().__init__(root, graph, class_name, training)
        self._input_specs = input_specs
        self.register_forward_pre_hook(_check_inputs, with_kwargs=True)

    def __deepcopy__(self, memo: dict) -> ExportedGraphModule:
        copied = super().__deepcopy__(memo)
        copied._input_specs = self._input_specs
        if _check_inputs not in copied._forward_pre_hooks.values():
            copied.register_forward_pre_hook(_check_inputs, with_kwargs=True)
        return copied


def _check_inputs(module: ExportedGraphModule, args: tuple, kwargs: dict) -> None:
    names = list(module._input_specs)
    given = dict(zip(names, args, strict=False)) | kwargs
    for name, (shape, dtype, dim) in module._input_specs.items():
        value = given.get(name)
        if not isinstance(value, torch.Tensor):
            raise TraceError(
                f"input {name!r} is missing or not a tensor (got {type(value).__name__})"
            )
        fixed = [i for i in range(len(shape)) if i != dim]
        if value.dim() != len(shape) or any(value.shape[i] != shape[i] for i in fixed):
            expected = ", ".join("batch" if i == dim else str(s) for i, s in enumerate(shape))
            raise TraceError(
                f"input {name!r} has shape {list(value.shape)}, but this graph was captured by "
                f"torch.export for shape [{expected}]: only the batch dimension is dynamic. "
                "Capture again with an example of the new size (pdcompile.trace)"
            )
        if value.dtype != dtype:
            raise TraceError(
                f"input {name!r} has dtype {value.dtype}, but the graph was captured for {dtype}"
            )


def _dynamic_shapes(inputs: BoundInputs, batch: Dim) -> dict[str, Any]:
    """The `dynamic_shapes` argument: the batch dimension of every tensor (dim 0 unless
    `inputs.batch_dims` says otherwise) is the shared `batch` dimension."""

    def dims(key: str, value: Any) -> dict[int, Dim] | None:
        if not isinstance(value, torch.Tensor):
            return None
        dim = inputs.batch_dim(key)
        return None if dim is None else {dim: batch}

    spec: dict[str, Any] = {}
    for name, value in inputs.arguments.items():
        kind = inputs.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:  # parameters of their own: `_explicit_keywords`
            spec |= {k: dims(k, v) for k, v in value.items() if isinstance(v, torch.Tensor)}
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            spec[name] = tuple(dims(f"{name}_{i}", v) for i, v in enumerate(value))
        else:
            spec[name] = dims(name, value)
    return spec


def _widened(inputs: BoundInputs) -> BoundInputs:
    """Example inputs of at least 2 rows: export turns a dimension of size 1 into the constant 1."""
    if inputs.batch_size >= 2:
        return inputs
    tensors = {}
    for name, value in inputs.tensors.items():
        dim = inputs.batch_dim(name)
        wide = dim is not None and value.shape[dim] == 1
        tensors[name] = torch.cat([value, value], dim=dim) if wide else value
    return inputs.with_tensors(tensors)


def _hoist_state_updates(graph: fx.Graph) -> None:
    """Move each buffer update (`copy_` into a `get_attr`, which functionalization appends at
    the end) to right after the value it writes, so it stays in the stage computing it."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        target = written_input(node)
        if isinstance(target, fx.Node) and target.op == "get_attr" and not node.users:
            latest = max(node.all_input_nodes, key=order.__getitem__)
            if latest.op != "get_attr":
                latest.append(node)


@contextlib.contextmanager
def _explicit_keywords(model: nn.Module, inputs: BoundInputs) -> Iterator[dict[str, Any]]:
    """While exporting, give `model.forward` a signature without `**kwargs`: its tensors become
    keyword parameters of their own and its constants are bound (torch's matching of
    `dynamic_shapes` asserts on `**kwargs`). Yields the keyword arguments to export with."""
    args, kwargs = inputs.call(inputs.tensors)
    parameters = inputs.signature.parameters
    keyword = [n for n, p in parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD]
    extra = inputs.arguments.get(keyword[0], {}) if keyword else {}
    if not extra:
        yield kwargs
        return
    bound = {k: v for k, v in extra.items() if not isinstance(v, torch.Tensor)}
    previous = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return previous(*args, **kwargs, **bound)

    explicit = [p for p in parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    explicit += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in extra
                 if k not in bound]  # fmt: skip
    forward.__signature__ = inspect.Signature(explicit)  # type: ignore[attr-defined]
    had = "forward" in vars(model)
    model.forward = forward
    try:
        yield {k: v for k, v in kwargs.items() if k not in bound}
    finally:
        if had:
            model.forward = previous
        else:
            del model.forward


def _export(model: nn.Module, inputs: BoundInputs, batch: Any) -> torch.export.ExportedProgram:
    """`torch.export.export` of the example with dim 0 of every tensor input as `batch`."""
    args, _ = inputs.call(inputs.tensors)
    with _explicit_keywords(model, inputs) as kwargs:
        model_output(model, args, kwargs)  # registers output dataclasses; may fail here
        with warnings.catch_warnings(), _without_partial_graph():
            warnings.filterwarnings("ignore", LEAFSPEC_WARNING, FutureWarning)  # torch's own
            return torch.export.export(model, args, kwargs, strict=False,
                                       dynamic_shapes=_dynamic_shapes(inputs, batch))  # fmt: skip


@contextlib.contextmanager
def _without_partial_graph() -> Iterator[None]:
    """torch.export prints a failed export's partial graph to stderr before it raises: thousands
    of lines for a real model, twice when the batch is tried both ways, above the TraceError
    that says what failed. The graph stays on the exception (`partial_fx_graph`, the cause of
    the TraceError); whatever else was written to stderr meanwhile is passed on."""
    written, partial = io.StringIO(), ""
    try:
        with contextlib.redirect_stderr(written):
            yield
    except Exception as e:
        partial = str(getattr(e, "partial_fx_graph", None) or "")
        raise
    finally:
        text = written.getvalue()
        sys.stderr.write(text.replace(f"{partial}\n", "") if partial else text)  # printed twice


def _fixed_batch(program: torch.export.ExportedProgram, inputs: BoundInputs) -> str | None:
    """The first input whose batch dimension export made a constant, or None."""
    for node in program.graph.find_nodes(op="placeholder"):
        if node.target not in inputs.tensors:
            continue
        value, dim = node.meta.get("val"), inputs.batch_dim(node.target)
        if (
            isinstance(value, torch.Tensor)
            and dim is not None
            and isinstance(value.shape[dim], int)
        ):
            return node.target
    return None


def _runs_one_more_row(
    program: torch.export.ExportedProgram, model: nn.Module, inputs: BoundInputs
) -> bool:
    """Whether the program (its guards on) runs on the example with one row more."""
    tensors = {}
    for name, value in inputs.tensors.items():
        dim = inputs.batch_dim(name)
        more = dim is not None
        tensors[name] = torch.cat([value, value.narrow(dim, 0, 1)], dim) if more else value
    more = inputs.with_tensors(tensors)
    args, _ = more.call(tensors)
    try:
        with _explicit_keywords(model, more) as kwargs, torch.no_grad():
            program.module()(*args, **kwargs)
    except Exception:
        return False
    return True


def capture_export(model: nn.Module, inputs: BoundInputs) -> ExportedGraphModule:
    """Export `model` with a dynamic batch dimension and return its fx graph.

    Raises:
        TraceError: export fails, or the model fixes the batch dimension.
    """
    inputs = _widened(inputs)
    try:
        program = _export(model, inputs, Dim("batch"))
    except Exception as named:
        # a guard torch cannot prove for every batch size under one named dimension (Llama4's
        # `16*B*min(64, 1024*B) == 1024*B`) often holds once torch infers the dimension itself
        try:
            program = _export(model, inputs, Dim.AUTO)
        except Exception:
            program = None
        fixed = program is not None and _fixed_batch(program, inputs)
        if program is not None and not fixed and not _runs_one_more_row(program, model, inputs):
            fixed = "batch"  # an inferred dimension with guards one more row fails
        if program is None or fixed:
            hint = ""
            if fixed or "batch" in str(named):
                hint = (
                    f". The model fixes the batch size (input {fixed or 'batch'}, also with the "
                    "dimension inferred): make it use x.shape[0] instead of a number, or name "
                    "inputs whose batch is not dim 0 in batch_dims="
                )
            raise TraceError(
                f"torch.export of {type(model).__name__} failed: "
                f"{describe_failure(named, model)}{hint}"
            ) from named
    gm = _graph_module(program, inputs, model)
    if not inplace_nodes(gm):
        return gm
    try:  # the same out-of-place rewrite as the fx path keeps the graph as exported
        functionalize(gm, record_values(gm, inputs.tensors))
        return gm
    except TraceError:  # a write through a view: functional ATen replays it
        functional = program.run_decompositions({})
        _views_as_reshapes(functional.graph_module)
        return _graph_module(functional, inputs, model)


def _views_as_reshapes(gm: fx.GraphModule) -> None:
    """`aten.view` -> `aten.reshape` in a functional graph, where nothing writes through a view
    so the two agree: re-tracing drops `.contiguous()` and records `reshape` as `view` wherever
    the fake strides say the input is contiguous, and a kernel whose real output strides differ
    (scaled_dot_product_attention after a transpose, T5) then fails the view at run time."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        node.target = torch.ops.aten.reshape.default
    gm.recompile()


def _buffer_reads_copied(graph: fx.Graph) -> None:
    """Point the reads of a buffer before its update at a copy: batch norm saves its running
    statistics for the backward, and the update written into them in place would fail the
    backward ("modified by an inplace operation"). Written buffers are statistics and counters:
    the copies are small."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        target = written_input(node)
        if not (isinstance(target, fx.Node) and target.op == "get_attr"):
            continue
        readers = [u for u in target.users if u is not node and order.get(u, -1) < order[node]]
        if not readers:
            continue
        with graph.inserting_after(target):
            copied = graph.call_method("clone", (target,))
        copied.meta = dict(target.meta)
        for reader in readers:
            reader.replace_input_with(target, copied)


def _copies_out_of_place(graph: fx.Graph) -> None:
    """`aten.copy(dst, src)` (what functionalization makes of `dst[...].copy_(src)`, DeepseekV3's
    attention) has no derivative: compute it as `src.to(dst.dtype).expand_as(dst)`, a fresh
    tensor (contiguous) holding the same values, through which gradients reach `src`."""
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.copy.default):
        dst, src = node.args[:2]
        value = dst.meta.get("val") if isinstance(dst, fx.Node) else None
        if value is None or not isinstance(src, fx.Node):
            continue
        with graph.inserting_before(node):
            cast = graph.call_method("to", (src,), {"dtype": value.dtype, "device": value.device})
            wide = graph.call_method("expand_as", (cast, dst))
            fresh = graph.call_method("contiguous", (wide,))
        for made in (cast, wide, fresh):
            made.meta = {k: v for k, v in node.meta.items() if k != "val"}
        fresh.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(fresh)
        graph.erase_node(node)


def _graph_module(
    program: torch.export.ExportedProgram, inputs: BoundInputs, model: nn.Module
) -> ExportedGraphModule:
    """The program's fx graph called with the tensor inputs by name, returning what `model`
    returns, with buffer updates beside their values and export's guards removed."""
    exported = program.module()
    graph = exported.graph
    _hoist_state_updates(graph)
    _buffer_reads_copied(graph)
    _copies_out_of_place(graph)
    for node in list(graph.nodes):
        # The export guards are replaced by _check_inputs, whose errors say what to do.
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
    for node in list(graph.find_nodes(op="placeholder")):
        if node.target not in inputs.tensors:
            if node.users:
                raise TraceError(f"constant argument {node.target!r} is used by the exported graph")
            graph.erase_node(node)
    names = [p.target for p in graph.find_nodes(op="placeholder")]
    out_spec = graph._codegen.pytree_info.out_spec
    graph._codegen = _PyTreeCodeGen(
        _PyTreeInfo(names, pytree.tree_structure(list(names)), out_spec)
    )
    specs = {n: (tuple(inputs.tensors[n].shape), inputs.tensors[n].dtype, inputs.batch_dim(n))
             for n in names}  # fmt: skip
    gm = ExportedGraphModule(exported, graph, type(model).__name__, model.training, specs)
    gm._in_spec = graph._codegen.pytree_info.in_spec
    gm._out_spec = out_spec
    gm.recompile()
    return gm
