"""Run a stage module on other weights than its own, as the streaming schedules do with the
weight versions they stash.

`torch.func.functional_call` does this for any module, finding the parameters' slots (tied
aliases included) at every call: about 6 µs per parameter, 0.15-0.26 ms per forward of a
28-parameter GPT stage on this machine's CPU, a sixth of the forward. A stage runs on its
copies every minibatch with the same slots, so `WeightSlots` finds them once and each call only
swaps dictionary entries (the same results and gradients: `tests/test_weight_slots.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn


class WeightSlots:
    """Where each of `module`'s parameters lives: (submodule, attribute) of every name under
    which it is registered, by its first name (as `named_parameters()` gives it)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        first = {id(p): name for name, p in module.named_parameters()}
        self._slots: dict[str, list[tuple[nn.Module, str]]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            owner, _, attr = name.rpartition(".")
            self._slots.setdefault(first[id(p)], []).append((module.get_submodule(owner), attr))

    @contextlib.contextmanager
    def swapped(self, weights: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Within the block, the module computes with `weights` (by first name) in place of its
        parameters; they are back afterwards, even after an error."""
        saved: list[tuple[nn.Module, str, Any]] = []
        try:
            for name, tensor in weights.items():
                for owner, attr in self._slots[name]:
                    saved.append((owner, attr, owner._parameters[attr]))
                    owner._parameters[attr] = tensor
            yield
        finally:
            for owner, attr, parameter in reversed(saved):
                owner._parameters[attr] = parameter

    def __call__(self, weights: Mapping[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
        """`module(*args, **kwargs)` computed with `weights`."""
        with self.swapped(weights):
            return self.module(*args, **kwargs)
