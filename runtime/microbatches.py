"""A step's batch cut into microbatches, as every rank of a pipeline holds it.

Every tensor of the inputs and targets is split along its batch dimension (dim 0, or what
`trace(batch_dims=)` said for an input) into `num_microbatches` parts whose sizes differ by at
most one (`torch.tensor_split`); values that are not tensors, and inputs without a batch
dimension, go to every part whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdcompile.core.errors import BatchError, ScheduleError
from pdcompile.core.ir import iter_tensors


@dataclass(frozen=True)
class Microbatch:
    args: tuple
    kwargs: dict[str, Any]
    target: Any
    weight: float  # its share of the loss
    rows: int
    step: int = 0  # the train step that gave it


@dataclass
class Batch:
    """One step's microbatches as the stages see them (every rank holds all of them)."""

    microbatches: list[Microbatch]

    @property
    def size(self) -> int:
        return len(self.microbatches)

    def items(self, first: int) -> dict[int, Microbatch]:
        """Microbatch index (from `first`) -> microbatch."""
        return {first + j: m for j, m in enumerate(self.microbatches)}


def split_batch(
    args: Sequence[Any], kwargs: dict[str, Any], targets: Any, num_microbatches: int, *,
    weighted: bool, dims: InputDims = None,
) -> Batch:  # fmt: skip
    """Split every tensor along its batch dimension into `num_microbatches` (sizes differ by at
    most one).

    `weighted`: each microbatch's loss counts by its share of the rows (gradient accumulation
    equal to the whole batch), else 1 (PipeDream minibatches). `dims`: the inputs' names in
    call order and the batch dimension of those not batch-major (`input_dims`).
    """
    arg_dims, kw_dims = _dims_of(args, kwargs, dims)
    rows = batch_rows(args, kwargs, dims)
    for path, value in iter_tensors(targets):
        if value.dim() and value.shape[0] != rows:
            raise BatchError(
                f"targets{' ' + path if path else ''} have {value.shape[0]} rows but the inputs "
                f"have {rows}: give one target row per input row (both are split along dim 0)"
            )
    if rows < num_microbatches:
        raise ScheduleError(
            f"a batch of {rows} rows cannot be split into {num_microbatches} microbatches; "
            "use a larger batch or fewer microbatches"
        )
    parts = [_split(a, num_microbatches, d) for a, d in zip(args, arg_dims, strict=True)]
    kw_parts = {k: _split(v, num_microbatches, kw_dims[k]) for k, v in kwargs.items()}
    target_parts = _split(targets, num_microbatches)
    split_args = [tuple(p[i] for p in parts) for i in range(num_microbatches)]
    split_kwargs = [{k: v[i] for k, v in kw_parts.items()} for i in range(num_microbatches)]
    parts = zip(split_args, split_kwargs, target_parts, strict=True)
    microbatches = []
    for args_k, kwargs_k, target_k in parts:
        size = batch_rows(args_k, kwargs_k, dims)
        weight = size / rows if weighted else 1.0
        microbatches.append(Microbatch(args_k, kwargs_k, target_k, weight, size))
    return Batch(microbatches)


def _split(value: Any, n: int, dim: int | None = 0) -> list[Any]:
    if isinstance(value, torch.Tensor):
        if dim is None or value.dim() == 0:
            return [value] * n
        return list(torch.tensor_split(value, n, dim=dim))
    if isinstance(value, (tuple, list)):
        parts = [_split(v, n) for v in value]
        return [type(value)(p[i] for p in parts) for i in range(n)]
    if isinstance(value, dict):
        parts = {k: _split(v, n) for k, v in value.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(n)]
    return [value] * n


# the graph's input names in call order, and the batch dimension of each input that is not
# batch-major (None: it has none); None: every input is batch-major
InputDims = tuple[Sequence[str], Mapping[str, int | None]] | None


def input_dims(input_specs: Mapping[str, str]) -> InputDims:
    """`InputDims` from a program's input specs (`float32[4, batch, 16]`: dim 1)."""
    dims: dict[str, int | None] = {}
    for name, spec in input_specs.items():
        sizes = spec[spec.find("[") + 1 : spec.rfind("]")].split(", ") if "[" in spec else []
        at = [i for i, size in enumerate(sizes) if "batch" in size]
        if sizes and sizes != [""] and at != [0]:
            dims[name] = at[0] if at else None
    return (tuple(input_specs), dims) if dims else None


def _dims_of(
    args: Sequence[Any], kwargs: Mapping[str, Any], dims: InputDims
) -> tuple[list[int | None], dict[str, int | None]]:
    names, special = dims or ((), {})
    arg_dims = [special.get(names[i], 0) if i < len(names) else 0 for i in range(len(args))]
    return arg_dims, {k: special.get(k, 0) for k in kwargs}


def batch_rows(args: Any, kwargs: Any = None, dims: InputDims = None) -> int:
    """The rows of a batch: the batch dimension of its first tensor that has one."""
    kwargs = kwargs or {}
    arg_dims, kw_dims = _dims_of(args, kwargs, dims)
    pairs = [*zip(args, arg_dims, strict=True), *((v, kw_dims[k]) for k, v in kwargs.items())]
    for value, dim in pairs:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and dim is not None:
            return value.shape[dim]
    raise ScheduleError(
        "the batch has no tensor with a batch dimension to split into microbatches; pass the "
        "model's inputs with the batch along dim 0"
    )
