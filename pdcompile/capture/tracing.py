"""`pdcompile.trace`: capture an `nn.Module` as a torch.fx GraphModule, the IR of later phases."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from pdcompile.capture.canonical import canonicalize
from pdcompile.capture.export_capture import capture_export
from pdcompile.capture.functionalize import functionalize, inplace_nodes
from pdcompile.capture.fx_capture import capture_fx
from pdcompile.capture.inputs import BoundInputs, bind_inputs
from pdcompile.capture.leaf_policy import LeafPolicy
from pdcompile.core.errors import TraceError, TraceWarning
from pdcompile.core.ir import (
    AUTO_LEAVES,
    BATCH_DIMS,
    CAPTURE,
    CONSTANTS,
    INPUTS,
    TRAINING,
    iter_tensors,
)
from pdcompile.core.progress import note, phase
from pdcompile.graph.mutation import is_inplace
from pdcompile.graph.node_runner import record_values
from pdcompile.graph.params import annotate_params
from pdcompile.graph.scope import annotate_scope
from pdcompile.graph.shapes import annotate_shapes
from pdcompile.graph.state import preserved_state

METHODS = ("auto", "fx", "export")
_TORCH_DIR = os.path.dirname(torch.__file__)
# An automatic leaf holding more than this share of the parameters defeats pipelining: try export.
DOMINANT_LEAF_SHARE = 0.5


def trace(
    model: nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    method: str = "auto",
    leaf_modules: Iterable[type[nn.Module] | str] = (),
    auto_leaf: bool = True,
    check: bool = True,
    batch_dims: Mapping[str, int | None] | None = None,
) -> fx.GraphModule:
    """Capture `model` as a GraphModule annotated with shapes, bytes, scopes and parameters.

    Args:
        model: the model, in the mode (train or eval) the graph should compute.
        example_inputs: positional arguments of one example call (a tensor or a tuple).
        example_kwargs: keyword arguments of that call. Tensor arguments become graph inputs;
            every other argument, and every optional argument not passed, is bound as a constant.
        method: "auto" (symbolic tracing, falling back to torch.export when tracing fails at the
            top level or leaves one automatic leaf holding most parameters), "fx" or "export".
        leaf_modules: extra leaves: module classes or qualified names.
        auto_leaf: turn submodules symbolic tracing cannot follow into leaves (with a warning).
        check: run the graph and the model on the example and compare their outputs (and, for
            a model in training mode, run the graph's backward once).
        batch_dims: inputs whose batch is not along dim 0, by graph input name: the dimension
            that holds it, or None for an input that has none (every microbatch gets it whole,
            e.g. a table all rows share). Export makes that dimension dynamic, and the runtime
            splits batches along it.

    Returns:
        A GraphModule, called with the tensor inputs only (by position or by name), returning what
        the model returns. `gm.meta` and `node.meta` carry the keys listed in `pdcompile.core.ir`.

    Raises:
        TraceError: no path captures the model, a captured graph computes something else, the
            model does not run on the example inputs, or it changes them in place.

    Example:
        >>> model, inputs = pdcompile.zoo.mlp()
        >>> gm = pdcompile.trace(model, inputs)
        >>> gm.meta["pdcompile.capture"]
        'fx'
    """
    with phase(f"capturing {type(model).__name__}"):
        if method not in METHODS:
            raise TraceError(f"method must be one of {METHODS}, got {method!r}")
        inputs = bind_inputs(model, example_inputs, example_kwargs, batch_dims)
        _check_devices(model, inputs)
        policy = LeafPolicy.from_user(model, leaf_modules)
        failures: list[str] = []
        fallback: _Traced | None = None
        if method in ("auto", "fx"):
            traced = _trace_symbolic(model, inputs, policy, auto_leaf, method, failures)
            if traced is not None:
                gm, auto = traced
                dominant = _dominant_leaf(model, auto) if method == "auto" else None
                if dominant is None:
                    try:
                        return _finish(gm, model, inputs, "fx", auto, check)
                    except TraceError as e:
                        if method == "fx":
                            raise
                        failures.append(f"fx: {e}")
                else:
                    failures.append(f"fx: {dominant}")
                    fallback = traced
        return _export_or_fallback(model, inputs, check, fallback, failures)


# a symbolically traced graph and its automatic leaves (qualified name -> why)
_Traced = tuple[fx.GraphModule, dict[str, str]]


def _trace_symbolic(
    model: nn.Module,
    inputs: BoundInputs,
    policy: LeafPolicy,
    auto_leaf: bool,
    method: str,
    failures: list[str],
) -> _Traced | None:
    """Symbolic tracing: the graph and its automatic leaves, or None with the failure added to
    `failures` (raised where `method` is "fx")."""
    try:
        note("symbolic tracing")
        return capture_fx(model, inputs, policy, auto_leaf)
    except TraceError as e:
        if method == "fx":
            raise
        failures.append(f"fx: {e}")
        return None


def _export_or_fallback(
    model: nn.Module,
    inputs: BoundInputs,
    check: bool,
    fallback: _Traced | None,
    failures: list[str],
) -> fx.GraphModule:
    """torch.export's graph; where export fails, the symbolically traced `fallback` (one leaf
    holding most of the model) with a `TraceWarning`, else a `TraceError` naming every path's
    failure (`failures`, export's added) and the remedies."""
    try:
        note("torch.export")
        gm = capture_export(model, inputs)
        return _finish(gm, model, inputs, "export", {}, check)
    except TraceError as e:
        if fallback is not None:
            gm, auto = fallback
            gm = _finish(gm, model, inputs, "fx", auto, check)
            warnings.warn(
                f"{type(model).__name__} was captured by symbolic tracing with one leaf "
                f"holding most of the model, which no pipeline can split: {failures[-1]}. "
                f"torch.export, tried next, failed:\n{e}\nA pipeline of this graph is "
                "bounded by that leaf (the default plan is then data parallelism). Remedies: "
                "fix what export reports, make the leaf's code traceable, or give "
                "leaf_modules= smaller parts",
                TraceWarning,
                stacklevel=3,  # trace()'s caller
            )
            return gm
        if not failures:
            raise
        failures.append(f"export: {e}")
        raise TraceError(
            f"no path could capture {type(model).__name__}: "
            + "; ".join(f.splitlines()[0] for f in failures)
            + ".\nRemedies: make the failing submodule traceable (no control flow on tensor "
            "values, no Python objects built from tensor values), make it a leaf "
            "(leaf_modules=[name]: it then runs whole inside one stage), cut the model before "
            "it (pipeline the part that captures and run the rest outside the pipeline), or "
            "pass example inputs the model accepts. In full:\n  - " + "\n  - ".join(failures)
        ) from e


def _dominant_leaf(model: nn.Module, auto: Mapping[str, str]) -> str | None:
    total = sum(p.numel() for p in model.parameters())
    for name in auto:
        share = sum(p.numel() for p in model.get_submodule(name).parameters()) / max(total, 1)
        if share > DOMINANT_LEAF_SHARE:
            return (
                f"submodule {name!r} had to become a leaf ({auto[name]}) and holds "
                f"{share:.0%} of the parameters"
            )
    return None


def _finish(
    gm: fx.GraphModule,
    model: nn.Module,
    inputs: BoundInputs,
    capture: str,
    auto: Mapping[str, str],
    check: bool,
) -> fx.GraphModule:
    """Complete the module's state, run the capture passes, check the graph against the model."""
    _complete_state(gm, model)
    gm.meta[CAPTURE] = capture
    gm.meta[TRAINING] = model.training
    gm.meta[INPUTS] = tuple(inputs.tensors)
    gm.meta[CONSTANTS] = tuple((k, repr(v)) for k, v in inputs.constants.items())
    gm.meta[BATCH_DIMS] = tuple(inputs.batch_dims.items())
    gm.bind_constants(gm.meta[CONSTANTS])
    gm.meta[AUTO_LEAVES] = tuple(auto.items())
    gm.graph.lint()
    annotate_scope(gm)
    saved = {n: t.detach().clone() for n, t in inputs.tensors.items() if not t.is_meta}
    try:
        try:
            annotate_shapes(gm, inputs.tensors)
        except Exception as e:
            raise TraceError(
                f"the graph captured by {capture} does not run on the example inputs "
                f"({_describe(inputs)}): {_failure(e)}; pass example inputs "
                f"{type(model).__name__} accepts (a batch of the shape, dtype and device it "
                "trains on)"
            ) from e
        if capture == "fx" and inplace_nodes(gm):
            functionalize(gm, record_values(gm, inputs.tensors))
        canonicalize(gm)  # the same graph in every process, whatever its hash seed
        annotate_params(gm)
        if check:
            _check_outputs(gm, model, inputs, capture)
            _check_backward(gm, inputs, capture)
    finally:
        _restore_inputs(gm, model, inputs, saved)
    if auto:
        lines = "\n".join(f"  {name}: {reason}" for name, reason in auto.items())
        warnings.warn(
            f"{len(auto)} submodule(s) of {type(model).__name__} became leaves because symbolic "
            f"tracing cannot follow them:\n{lines}",
            TraceWarning,
            stacklevel=3,
        )
    return gm


def _complete_state(gm: fx.GraphModule, model: nn.Module) -> None:
    """Give `gm` every parameter and buffer of `model` under every original name.

    fx copies only the attributes its graph uses and export keeps one name per tied tensor; the
    missing names are registered again (same tensors), so `gm.state_dict()` has the model's keys.
    Missing paths only run through modules fx created fresh, never through the user's modules.
    """
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        owner_name, _, attr = name.rpartition(".")
        owner = gm
        for part in owner_name.split(".") if owner_name else []:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        persistent = attr not in model.get_submodule(owner_name)._non_persistent_buffers_set
        if attr in owner._parameters or attr in owner._buffers:
            if not persistent:  # fx and export copy every buffer as persistent
                owner._non_persistent_buffers_set.add(attr)
        elif isinstance(tensor, nn.Parameter):
            owner.register_parameter(attr, tensor)
        else:
            owner.register_buffer(attr, tensor, persistent=persistent)


def _check_devices(model: nn.Module, inputs: BoundInputs) -> None:
    """Example inputs on the device of the model's tensors (a meta model takes any inputs)."""
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    if len(devices) != 1 or next(iter(devices)).type == "meta":
        return
    (device,) = devices
    for name, tensor in inputs.tensors.items():
        if tensor.device != device:
            raise TraceError(
                f"example input {name!r} is on {tensor.device} but {type(model).__name__}'s "
                f"parameters are on {device}: move the inputs there (.to({str(device)!r}))"
            )


def _describe(inputs: BoundInputs) -> str:
    return ", ".join(
        f"{name}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"
        for name, t in inputs.tensors.items()
    )


def _failure(error: BaseException) -> str:
    """The error's first line and, from fx's note, the node it ran."""
    text = str(error).strip()
    node = re.search(r"While executing %(\w+)", text)
    first = (text.splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}" + (f" (at node {node.group(1)})" if node else "")


def _restore_inputs(
    gm: fx.GraphModule, model: nn.Module, inputs: BoundInputs, saved: dict[str, torch.Tensor]
) -> None:
    """Put back example inputs the graph or the model changed in place, and refuse the model:
    a stage must not write into the tensors it receives."""
    changed = [n for n, before in saved.items() if not _same(inputs.tensors[n], before)]
    if not changed:
        return
    with torch.no_grad():
        for name in changed:
            inputs.tensors[name].copy_(saved[name])
    where = ""
    (placeholder,) = gm.graph.find_nodes(op="placeholder", target=changed[0]) or [None]
    for user in placeholder.users if placeholder is not None else ():
        module = gm.get_submodule(user.target) if user.op == "call_module" else None
        if is_inplace(user, module):
            where = f" at node {user.name}{user_line(user)}"
    raise TraceError(
        f"{type(model).__name__} changes its input {changed[0]!r} in place{where}: pipeline "
        "stages must not write into the tensors they receive; compute a new tensor instead "
        "(x = x * 2, not x.mul_(2) or x *= 2)"
    )


def user_line(node: fx.Node) -> str:
    """` (at file.py:12: x.mul_(2))`: the innermost frame of the node's stack trace outside
    torch, or nothing."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    frames = [
        (match.groups(), lines[i + 1].strip() if i + 1 < len(lines) else "")
        for i, line in enumerate(lines)
        if (match := re.match(r'\s*File "(.+)", line (\d+)', line))
    ]
    user = [f for f in frames if not f[0][0].startswith(_TORCH_DIR)]
    if not user:
        return ""
    (path, number), code = user[-1]
    return f" (at {path}:{number}: {code})"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or (
        a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    )


def _check_outputs(gm: fx.GraphModule, model: nn.Module, inputs: BoundInputs, capture: str) -> None:
    """Compare the graph's outputs with the model's on the example (same RNG, state restored)."""
    tensors = [*inputs.tensors.values(), *model.parameters(), *model.buffers()]
    if any(t.device.type == "meta" for t in tensors):
        return  # nothing to compare: a meta model has shapes, not values
    args, kwargs = inputs.call(inputs.tensors)
    with preserved_state(model), preserved_state(gm), torch.enable_grad():
        torch.manual_seed(0)
        expected = list(iter_tensors(model(*args, **kwargs)))
        torch.manual_seed(0)
        try:
            actual = list(iter_tensors(gm(**inputs.tensors)))
        except Exception as e:
            raise TraceError(
                f"the graph captured by {capture} fails where {type(model).__name__} runs: "
                f"{_failure(e)}"
            ) from e
    name = type(model).__name__
    if [p for p, _ in actual] != [p for p, _ in expected]:
        raise TraceError(
            f"the graph captured by {capture} returns tensors {[p for p, _ in actual]}, but "
            f"{name} returns {[p for p, _ in expected]}"
        )
    for (path, a), (_, e) in zip(actual, expected, strict=True):
        if a.shape != e.shape or a.dtype != e.dtype:
            raise TraceError(
                f"output {path or 'output'} of the graph captured by {capture} is "
                f"{a.dtype}{list(a.shape)}, but {name} gives {e.dtype}{list(e.shape)}"
            )
        if a.is_floating_point() and not torch.allclose(a, e, rtol=1e-4, atol=1e-5, equal_nan=True):
            diff = (a.detach() - e.detach()).abs().max().item()
            raise TraceError(
                f"output {path or 'output'} of the graph captured by {capture} differs from "
                f"{name}'s by up to {diff:.3g}: the model's Python takes a path the graph does "
                "not record (e.g. a branch on a global flag); use method='export' or leaf_modules"
            )
        if not a.is_floating_point() and not torch.equal(a, e):
            raise TraceError(
                f"output {path or 'output'} of the graph captured by {capture} differs"
            )


def _check_backward(gm: fx.GraphModule, inputs: BoundInputs, capture: str) -> None:
    """Run the graph's backward once on the example (training graphs with a differentiable
    output): a node without a derivative is a `TraceError` naming it and its source line."""
    tensors = [*inputs.tensors.values(), *gm.parameters()]
    if not gm.meta[TRAINING] or any(t.device.type == "meta" for t in tensors):
        return
    wrt = [p for p in gm.parameters() if p.requires_grad]
    with preserved_state(gm), torch.enable_grad():
        torch.manual_seed(0)
        outputs = [t for _, t in iter_tensors(gm(**inputs.tensors)) if t.requires_grad]
        if not outputs or not wrt:
            return
        total = sum(t.float().sum() for t in outputs)
        try:
            torch.autograd.grad(total, wrt, allow_unused=True)
        except RuntimeError as e:
            raise TraceError(
                f"the graph captured by {capture} computes the forward but not the backward: "
                f"{_failure(e)}{_backward_culprit(gm, inputs)}; make that operation "
                "differentiable in the model (an out-of-place op instead of an in-place write "
                "into a fresh tensor), or report it with the node's line"
            ) from e


def _backward_culprit(gm: fx.GraphModule, inputs: BoundInputs) -> str:
    """` at node copy (at model.py:12: ...)`: the node whose backward failed, found by running
    the backward again under anomaly detection (which records each op's forward frame)."""
    grads = {p: p.grad for p in gm.parameters()}
    with preserved_state(gm), torch.enable_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly(check_nan=False):
                torch.manual_seed(0)
                outputs = [t for _, t in iter_tensors(gm(**inputs.tensors)) if t.requires_grad]
                sum(t.float().sum() for t in outputs).backward()
        except RuntimeError:
            pass
        finally:
            for param, grad in grads.items():
                param.grad = grad
    frames = "\n".join(str(w.message) for w in seen)
    names = re.findall(r'File "<eval_with_key>[^"]*", line \d+.*\n\s*(\w+) = ', frames)
    node = next((n for n in gm.graph.nodes if names and n.name == names[-1]), None)
    return "" if node is None else f" at node {node.name}{user_line(node)}"
