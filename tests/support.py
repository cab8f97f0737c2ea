"""Shared helpers: zoo examples, fresh inputs, and captured graphs cached per session."""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pdcompile
from pdcompile import zoo
from pdcompile.capture.inputs import bind_inputs
from pdcompile.core.ir import iter_tensors


def example(name: str, *, eval_mode: bool = False) -> tuple[torch.nn.Module, tuple, dict]:
    """A zoo model with its example call, as `(model, args, kwargs)`."""
    if name in zoo.HF_ZOO:
        pytest.importorskip("transformers")
    model, args, *rest = getattr(zoo, name)()
    if eval_mode:
        model.eval()
    return model, args, (rest[0] if rest else {})


def fresh_like(
    tensors: dict[str, torch.Tensor], batch: int, seed: int = 1
) -> dict[str, torch.Tensor]:
    """New values of the same kinds and trailing shapes, with `batch` rows."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        shape = (batch, *t.shape[1:])
        if t.is_floating_point():
            out[name] = torch.randn(shape, generator=gen, dtype=t.dtype)
        else:
            low, high = int(t.min()), int(t.max()) + 1
            out[name] = torch.randint(low, high, shape, generator=gen, dtype=t.dtype)
    return out


def flat(value: Any) -> list[torch.Tensor]:
    return [t for _, t in iter_tensors(value)]


_CACHE: dict[tuple, tuple] = {}


def captured(name: str, *, eval_mode: bool = True, **options: Any):
    """`(model, gm, bound inputs, warnings)` for a zoo model, captured once per test session."""
    key = (name, eval_mode, tuple(sorted(options.items())))
    if key not in _CACHE:
        model, args, kwargs = example(name, eval_mode=eval_mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gm = pdcompile.trace(model, args, example_kwargs=kwargs, **options)
        bound = bind_inputs(model, args, kwargs)
        _CACHE[key] = (
            model,
            gm,
            bound,
            [w for w in caught if w.category is pdcompile.TraceWarning],
        )
    return _CACHE[key]


class Ops(TorchDispatchMode):
    """Counts the aten operations run."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class WarningRecords(logging.Handler):
    """Keeps the messages of the warnings logged while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
