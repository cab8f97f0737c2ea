"""A step's batch cut into microbatches, as every rank of a pipeline holds it.

Every tensor of the inputs and targets is split along dim 0 into `num_microbatches` parts whose
sizes differ by at most one (`torch.tensor_split`); values that are not tensors go to every part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdcompile.errors import BatchError, ScheduleError
from pdcompile.ir import iter_tensors


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
    weighted: bool,
) -> Batch:  # fmt: skip
    """Split every tensor along dim 0 into `num_microbatches` (sizes differ by at most one).

    `weighted`: each microbatch's loss counts by its share of the rows (gradient accumulation
    equal to the whole batch), else 1 (PipeDream minibatches).
    """
    rows = batch_rows(args, kwargs)
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
    parts = [_split(a, num_microbatches) for a in args]
    kw_parts = {k: _split(v, num_microbatches) for k, v in kwargs.items()}
    target_parts = _split(targets, num_microbatches)
    split_args = [tuple(p[i] for p in parts) for i in range(num_microbatches)]
    split_kwargs = [{k: v[i] for k, v in kw_parts.items()} for i in range(num_microbatches)]
    parts = zip(split_args, split_kwargs, target_parts, strict=True)
    microbatches = []
    for args_k, kwargs_k, target_k in parts:
        size = batch_rows(args_k, kwargs_k)
        weight = size / rows if weighted else 1.0
        microbatches.append(Microbatch(args_k, kwargs_k, target_k, weight, size))
    return Batch(microbatches)


def _split(value: Any, n: int) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, n, dim=0))
    if isinstance(value, (tuple, list)):
        parts = [_split(v, n) for v in value]
        return [type(value)(p[i] for p in parts) for i in range(n)]
    if isinstance(value, dict):
        parts = {k: _split(v, n) for k, v in value.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(n)]
    return [value] * n


def batch_rows(args: Any, kwargs: Any = None) -> int:
    """The rows of a batch: dim 0 of its first tensor with a dimension."""
    for value in [*args, *(kwargs or {}).values()]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ScheduleError(
        "the batch has no tensor with a batch dimension to split into microbatches; pass the "
        "model's inputs with the batch along dim 0"
    )
