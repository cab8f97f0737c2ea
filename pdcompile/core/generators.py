"""The caller's random generators, kept: what pdcompile runs for itself draws nothing from them.

`compile` and `analyze` run the model (capture, the backward check, the profile at each row
count, adaptive repeats) and measure the cluster (probe modules initialised at random), and how
much of that runs depends on caches and on the machine's load. Run under `generators_kept`, none
of it moves the generators training draws its dropout masks from, so two runs of one seed train
alike and a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def generators_kept(device: torch.device | str | None = None) -> Iterator[None]:
    """Run the body, then put back the CPU's generator and, for a CUDA `device`, its own."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = []
    if device.type == "cuda":
        cuda = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda):
        yield
