"""Running a model for analysis without lasting effects on it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module) -> Iterator[None]:
    """Run a block without lasting effects on `module`'s buffers or on the RNG state."""
    saved = [(b, b.detach().clone()) for b in module.buffers() if b.device.type != "meta"]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
