"""Capture by torch.fx symbolic tracing, with the leaf policy and automatic leaves.

A submodule whose own code cannot be traced (control flow on tensor values, calls fx cannot see
through) is found as the innermost module being traced when tracing failed; with `auto_leaf` it
becomes a leaf and tracing starts again, so every leaf sits as deep in the hierarchy as possible.
"""

from __future__ import annotations

import functools
import operator
import os
import sys
import traceback
from typing import Any

import torch.fx as fx
import torch.nn as nn

from pdcompile.capture.graph_module import CapturedGraphModule
from pdcompile.capture.inputs import BoundInputs
from pdcompile.capture.leaf_policy import TRACEABLE_FORWARDS, LeafPolicy
from pdcompile.capture.outputs import keep_output_structure, model_output, returns_dict
from pdcompile.core.errors import TraceError

_TORCH_DIR = os.path.dirname(os.path.dirname(fx.__file__))
_MAX_AUTO_LEAVES = 256


class _Untraceable(Exception):
    """Raised out of the innermost traced-through module whose forward failed."""

    def __init__(self, qualified_name: str, reason: str) -> None:
        super().__init__(qualified_name, reason)
        self.qualified_name = qualified_name
        self.reason = reason


def describe_failure(error: BaseException, model: nn.Module | None = None) -> str:
    """One line: where (the innermost submodule of `model` running, if given and not the
    model itself), the error, and the innermost source line outside torch that led to it."""
    text = str(error).strip()
    message = f"{type(error).__name__}: {text.splitlines()[0] if text else '(no message)'}"
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(_TORCH_DIR)
    ]
    if frames:
        f = frames[-1]
        message += f" (at {f.filename}:{f.lineno}: {(f.line or '').strip()})"
    where = failing_submodule(model, error) if model is not None else None
    if where is None:
        return message
    return f"in submodule {where!r} ({type(model.get_submodule(where)).__name__}): {message}"


def failing_submodule(model: nn.Module, error: BaseException) -> str | None:
    """The qualified name of the innermost submodule of `model` whose code was running when
    `error` was raised (read off the traceback's `self`), or None for the model's own code."""
    names = {id(m): name for name, m in model.named_modules() if name}
    found = None
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in names and isinstance(owner, nn.Module):
            found = names[id(owner)]
        tb = tb.tb_next
    return found


_TORCH = os.path.dirname(os.path.abspath(fx.__file__))[: -len(os.sep + "fx")]
# torch.fx's filter (fx.experimental.symbolic_shapes.uninteresting_files) by path: calling it
# imports torch._dynamo and torch._inductor to read their modules' file names; and this file
# (`_Proxy.__setitem__` records item assignments)
_SKIPPED = {os.path.join(_TORCH, *p.split("/")) for p in (
    "__init__.py", "_compile.py", "fx/_symbolic_trace.py", "fx/interpreter.py", "fx/proxy.py",
    "fx/experimental/recording.py", "fx/experimental/sym_node.py",
    "fx/experimental/symbolic_shapes.py", "export/_trace.py", "_inductor/sizevars.py",
    "_library/custom_ops.py", "_library/fake_impl.py", "_logging/_internal.py",
    "_logging/structured.py", "_subclasses/fake_tensor.py", "_subclasses/meta_utils.py",
)} | {"<string>", os.path.abspath(__file__)}  # fmt: skip
_SKIPPED_DIRS = tuple(os.path.join(_TORCH, d) + os.sep for d in ("_dynamo", "_higher_order_ops"))


def _user_frames(frames: traceback.StackSummary) -> traceback.StackSummary:
    """fx's `_filter_traceback_frames`: the frames from the first `forward` on, less torch's
    tracing machinery."""
    first = next((i for i, f in enumerate(frames) if f.name == "forward"), None)
    if first is None:
        return traceback.StackSummary()
    return traceback.StackSummary.from_list([
        f for f in frames[first:]
        if f.filename not in _SKIPPED and not f.filename.startswith(_SKIPPED_DIRS)
    ])  # fmt: skip


class _Proxy(fx.Proxy):
    """fx's Proxy, with item assignment (`mask[:, 0] = 1`): an `operator.setitem` node, which
    `functionalize` rewrites out of place."""

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


class _Tracer(fx.Tracer):
    def __init__(self, policy: LeafPolicy, inputs: BoundInputs) -> None:
        super().__init__()
        # fx's own recording (record_stack_traces) symbolises through torch._C._profiler, which
        # imports torch._dynamo and torch._inductor (1-7 s of a cold start); create_node records
        # the same frames with the standard library instead
        self.record_stack_traces = False
        self.policy = policy
        self.inputs = inputs

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        if not node.stack_trace:
            frames = traceback.StackSummary.extract(
                traceback.walk_stack(sys._getframe(1)), lookup_lines=False
            )
            frames.reverse()  # outermost first, as fx records them
            user = _user_frames(frames)
            if user:
                node.stack_trace = "".join(user.format()).strip()
        return node

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self.policy.is_leaf(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        override = TRACEABLE_FORWARDS.get(type(m))
        if override is not None:
            forward = functools.partial(override, m)
        name = self.path_of_module(m)
        if self.is_leaf_module(m, name):
            return super().call_module(m, forward, args, kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except _Untraceable:
            raise
        except Exception as e:
            raise _Untraceable(name, describe_failure(e)) from e

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None):
        # One placeholder per tensor input; every other argument keeps its value (see BoundInputs).
        placeholders = {
            name: self.create_proxy("placeholder", name, (), {}) for name in self.inputs.tensors
        }
        args, kwargs = self.inputs.call(placeholders)

        def traced(root: nn.Module) -> Any:
            return root_fn(root, *args, **kwargs)

        return traced, [self.root]


def capture_fx(
    model: nn.Module, inputs: BoundInputs, policy: LeafPolicy, auto_leaf: bool
) -> tuple[fx.GraphModule, dict[str, str]]:
    """Trace `model` symbolically; return the GraphModule and the automatic leaves with reasons.

    Raises:
        TraceError: tracing fails in the model's own `forward` (or, without `auto_leaf`, anywhere).
    """
    for _ in range(_MAX_AUTO_LEAVES):
        tracer = _Tracer(policy, inputs)
        try:
            graph = tracer.trace(model)
        except _Untraceable as e:
            if not auto_leaf:
                raise TraceError(
                    f"symbolic tracing cannot follow submodule {e.qualified_name!r} of "
                    f"{type(model).__name__}: {e.reason}. Remedies: auto_leaf=True, "
                    f"leaf_modules=[{e.qualified_name!r}], or method='export'"
                ) from e
            policy = policy.with_auto_leaf(e.qualified_name, e.reason)
            continue
        except Exception as e:
            raise TraceError(
                f"symbolic tracing of {type(model).__name__}.forward failed: "
                f"{describe_failure(e, model)}"
            ) from e
        gm = CapturedGraphModule(model, graph, type(model).__name__, model.training)
        if returns_dict(gm):
            keep_output_structure(gm, model_output(model, *inputs.call(inputs.tensors)))
        return gm, dict(policy.auto)
    raise TraceError(
        f"symbolic tracing of {type(model).__name__} needed more than {_MAX_AUTO_LEAVES} automatic "
        "leaves; use method='export' or name leaf modules"
    )
