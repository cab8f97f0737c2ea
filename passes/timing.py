"""How the cost passes time a piece of work on a device: one timer and one grad-call overhead,
shared by the node profile (`profile.py`) and the step costs (`step_costs.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

Timer = Callable[[Callable[[], object]], float]

# Bytes written to push a measurement's data out of the caches: twice a large last-level cache
# (32 MiB on this project's CPUs; an H100's L2 is 50 MiB).
EVICT_BYTES = 64 * 2**20


def cache_evictor(device: torch.device) -> Callable[[], None]:
    """A function that overwrites `EVICT_BYTES` on `device`, so the next timed work finds its
    data in memory, not in the caches: as an optimizer step finds the weights and state a
    step's forwards and backwards pushed out (measured on this machine: an SGD step with
    momentum over 0.5 MB of parameters took 0.41 ms warm, 0.76 ms cold)."""
    scratch = torch.zeros(EVICT_BYTES // 4, device=device)

    def evict() -> None:
        scratch.add_(1.0)

    return evict


def device_timer(device: torch.device) -> Timer:
    """Seconds of one call of a function: CUDA events on a GPU (the device's own time), the
    wall clock elsewhere."""
    if device.type == "cuda":

        def cuda_time(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return cuda_time

    def wall_time(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return wall_time


def grad_call_overhead(device: torch.device, timer: Timer, repeats: int) -> float:
    """The fixed cost of one isolated `torch.autograd.grad` call (its fastest run over a view,
    whose backward does no work), which a whole backward pass pays once, not once per node or
    once for the loss and once for the rest."""
    x = torch.ones(1, device=device, requires_grad=True)
    with torch.enable_grad():
        y = x.view_as(x)
    grad = torch.ones_like(y)
    return min(
        timer(lambda: torch.autograd.grad(y, x, grad, retain_graph=True)) for _ in range(repeats)
    )
