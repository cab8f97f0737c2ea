"""The loss of a microbatch, checked: `loss_fn` raising or not returning a scalar tensor is a
`LossError` that says where, and what it was given."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdcompile.core.errors import LossError


def checked_loss(
    loss_fn: Callable[[Any, Any], torch.Tensor], out: Any, target: Any, where: str
) -> torch.Tensor:
    """`loss_fn(out, target)`, which must give a scalar tensor (`where`: the stage, rank,
    microbatch and step, for the message)."""
    try:
        loss = loss_fn(out, target)
    except Exception as exc:
        raise LossError(
            f"loss_fn raised {type(exc).__name__} {where}: {_first_line(exc)}; it was given "
            f"the model's output ({_describe(out)}) and the microbatch's targets "
            f"({_describe(target)}): pass train_step the targets loss_fn expects"
        ) from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise LossError(
            f"loss_fn returned {_describe(loss)} {where}; it must return a scalar tensor "
            "(reduce the loss, e.g. with .mean())"
        )
    return loss


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _describe(value: Any) -> str:
    """`Tensor float32[4, 10]`, `None`, `dict with keys ['logits']`, ..."""
    if isinstance(value, torch.Tensor):
        return f"Tensor {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, dict):
        return f"{type(value).__name__} with keys {list(value)[:6]}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return "None" if value is None else type(value).__name__
