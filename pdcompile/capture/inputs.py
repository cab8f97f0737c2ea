"""The example call of a model, split into graph inputs (tensors) and bound constants."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from pdcompile.core.errors import TraceError
from pdcompile.core.ir import iter_tensors

# Arguments bound to these values when the caller leaves them out: a pipeline trains without a
# key/value cache, and a cache object in the output defeats torch.export.
IMPLIED_CONSTANTS = {"use_cache": False}


@dataclass(frozen=True)
class BoundInputs:
    """`model.forward`'s signature bound to the example inputs.

    Tensor arguments become graph inputs (placeholders), named after the argument (`args_0`,
    `args_1`, ... for `*args`; the key for `**kwargs`). Every other argument, and every optional
    argument that was not passed, is a constant: `if mask is not None` takes the example's branch.
    """

    signature: inspect.Signature
    arguments: Mapping[str, Any]  # as bound: *args as a tuple, **kwargs as a dict
    tensors: Mapping[str, torch.Tensor]  # graph input name -> example tensor, in call order
    constants: Mapping[str, Any]  # argument name -> value bound into the graph
    batch_dims: Mapping[str, int | None] = field(default_factory=dict)  # not dim 0 (None: none)

    def batch_dim(self, name: str) -> int | None:
        """The dimension of input `name` that holds the batch (None: it has none)."""
        tensor = self.tensors[name]
        return self.batch_dims.get(name, 0) if tensor.dim() else None

    def call(self, values: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """`(args, kwargs)` for `forward`, with each graph input replaced by `values[name]`."""
        bound = self.signature.bind_partial()
        for name, value in self.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                value = tuple(
                    values[f"{name}_{i}"] if isinstance(v, torch.Tensor) else v
                    for i, v in enumerate(value)
                )
            elif kind is inspect.Parameter.VAR_KEYWORD:
                value = {
                    k: values[k] if isinstance(v, torch.Tensor) else v for k, v in value.items()
                }
            elif isinstance(value, torch.Tensor):
                value = values[name]
            bound.arguments[name] = value
        return bound.args, bound.kwargs

    @property
    def batch_size(self) -> int:
        """Rows of the first tensor input with a batch dimension (1 if none has one)."""
        for name, tensor in self.tensors.items():
            if (dim := self.batch_dim(name)) is not None:
                return tensor.shape[dim]
        return 1

    def with_tensors(self, tensors: Mapping[str, torch.Tensor]) -> BoundInputs:
        """The same call with other tensors for the graph inputs."""
        args, kwargs = self.call(tensors)
        bound = self.signature.bind(*args, **kwargs)
        return BoundInputs(self.signature, dict(bound.arguments), dict(tensors), self.constants,
                           self.batch_dims)  # fmt: skip


def bind_inputs(
    model: nn.Module,
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None,
    batch_dims: Mapping[str, int | None] | None = None,
) -> BoundInputs:
    """Bind the example call to `model.forward`'s signature.

    Raises:
        TraceError: the arguments do not fit the signature, no tensor is passed, a tensor sits
            inside a container (pass such tensors as separate arguments), or `batch_dims` names
            no tensor input or a dimension it lacks.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise TraceError(
            f"example_inputs must be a tuple of the model's positional arguments, got "
            f"{type(example_inputs).__name__}; wrap a single tensor as (tensor,)"
        )
    kwargs = dict(example_kwargs or {})
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*example_inputs, **kwargs)
    except TypeError as e:
        raise TraceError(
            f"the example inputs do not fit {type(model).__name__}.forward{signature}: {e}"
        ) from None
    keywords = [n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD]
    config = getattr(model, "config", None)
    for name, value in IMPLIED_CONSTANTS.items():
        if name in signature.parameters and name not in bound.arguments:
            bound.arguments[name] = value
        elif name not in signature.parameters and keywords and hasattr(config, name):
            # taken only through **kwargs (GraniteMoe) but a setting of the model's config
            extra = bound.arguments.setdefault(keywords[0], {})
            extra.setdefault(name, value)

    tensors: dict[str, torch.Tensor] = {}
    constants: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            items = {f"{name}_{i}": v for i, v in enumerate(value)}
        elif kind is inspect.Parameter.VAR_KEYWORD:
            items = dict(value)
        else:
            items = {name: value}
        for key, item in items.items():
            if isinstance(item, torch.Tensor):
                tensors[key] = item
            elif next(iter_tensors(item), None) is not None:
                raise TraceError(
                    f"argument {key!r} of {type(model).__name__}.forward is a "
                    f"{type(item).__name__} holding tensors; pdcompile takes tensors as separate "
                    "arguments: unpack them in a small wrapper module"
                )
            else:
                constants[key] = item
    if not tensors:
        raise TraceError(
            f"no tensor among the example inputs of {type(model).__name__}; pass at least one "
            "example batch as a tensor"
        )
    return BoundInputs(signature, dict(bound.arguments), tensors, constants,
                       _checked_batch_dims(model, tensors, batch_dims or {}))  # fmt: skip


def _checked_batch_dims(
    model: nn.Module, tensors: Mapping[str, torch.Tensor], batch_dims: Mapping[str, Any]
) -> dict[str, int | None]:
    """`batch_dims` with negative dimensions made positive, each checked against its input."""
    checked: dict[str, int | None] = {}
    for name, dim in batch_dims.items():
        if name not in tensors:
            close = difflib.get_close_matches(str(name), list(tensors), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise TraceError(
                f"batch_dims names {name!r}, which is no tensor input of "
                f"{type(model).__name__} (its tensor inputs: {list(tensors)}){hint}"
            )
        rank = tensors[name].dim()
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)
                                or not -rank <= dim < rank):  # fmt: skip
            raise TraceError(
                f"batch_dims[{name!r}] = {dim!r}, but input {name!r} has {rank} dimensions "
                f"(shape {list(tensors[name].shape)}): give the dimension that holds the batch, "
                "or None for an input every microbatch gets whole"
            )
        if dim is None or dim % rank:
            checked[name] = None if dim is None else dim % rank
    return checked
