"""Replicated stages reduce their gradients while the backward still runs, as torch's DDP does.

A stage on several replicas sums its gradients over them once per step (the `allreduce` action).
Under a synchronous schedule whose backward runs fused (`1f1b`, `gpipe`, `interleaved-1f1b`),
the replica's last backward of the step makes each gradient final as autograd accumulates it.
`GradBuckets` registers a `register_post_accumulate_grad_hook` on each parameter; during that
last backward (`armed`) a hook marks its parameter ready, and a bucket whose parameters are all
ready starts its asynchronous all-reduce at once (`Comm.start_all_reduce`), overlapped with the
rest of the backward. The earlier backwards of the step only accumulate (their hooks return at
once). The `allreduce` action then starts the buckets not started yet (a parameter no backward
reached holds zeros), and waits for them all before the optimizer's step.

Buckets (`plan_buckets`) follow the parameters in reverse order, the order the backward makes
their gradients final, like DDP's: a gradient of over `COALESCE_MAX_BYTES` is a bucket of its
own, reduced in place (no copies in and out of a flat buffer, which cost as much as the transfer
on a CPU); the smaller ones are flattened together into buckets of up to `BUCKET_BYTES` (DDP's
25 MiB), each closed when full. Buckets start strictly in order, so every replica issues the same
collectives in the same order (gloo and NCCL match them by order); a bucket ready before the one
ahead of it waits for it.

`overlap_triggers` (`pdcompile/scheduling/reduce_overlap.py`, torch-free: the simulator prices the
same)
decides where this is safe. Elsewhere the `allreduce` action starts every bucket itself and
waits for them together. The
streaming schedules (`pipedream`, `2bw`) reduce at the action: their gradients live on weight
versions until `collect`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from pdcompile.passes.planning.action_costs import BUCKET_BYTES, COALESCE_MAX_BYTES
from pdcompile.runtime.comm import Comm

__all__ = ["GradBuckets", "plan_buckets"]


def plan_buckets(
    sizes: Sequence[int], cap: int = BUCKET_BYTES, whole: int = COALESCE_MAX_BYTES
) -> list[list[int]]:
    """The buckets of tensors of `sizes` bytes, as lists of their indices, in the order they
    start: from the last tensor to the first; a tensor of over `whole` bytes alone, the others
    gathered until a bucket holds `cap` bytes.

    >>> plan_buckets([4, 4_000_000, 4, 4_000_000], cap=8)
    [[3], [1], [2, 0]]
    """
    buckets, small, held = [], [], 0
    for i in reversed(range(len(sizes))):
        if sizes[i] > whole:
            buckets.append([i])
            continue
        small.append(i)
        held += sizes[i]
        if held >= cap:
            buckets.append(small)
            small, held = [], 0
    if small:
        buckets.append(small)
    return buckets


class GradBuckets:
    """The buckets of one stage replica's gradients (docs in the module).

    Args:
        params: the parameters whose gradients the replicas sum (in the module's order).
        comm: the rank's communication.
        group: the ranks of the stage's replicas.
        key: what names the stage's reduction on every rank (bucket i adds `i`).
    """

    def __init__(
        self, params: Sequence[nn.Parameter], comm: Comm, group: tuple[int, ...], key: tuple
    ) -> None:
        self.params = list(params)
        self.comm, self.group, self.key = comm, group, key
        self.buckets = plan_buckets([p.numel() * p.element_size() for p in self.params])
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets)
                          for p in (self.params[i] for i in bucket)}  # fmt: skip
        self.armed = False
        self.ready = [0] * len(self.buckets)
        self.started = 0  # buckets started so far this step (in order)
        self.waits: list[Callable[[], None]] = []
        self.early = 0  # buckets the last step started from its backward (the others: finish)
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._accumulated)

    def arm(self) -> None:
        """The replica's last backward of the step begins: its gradients become final."""
        self.ready = [0] * len(self.buckets)
        self.started, self.waits, self.armed = 0, [], True

    def disarm(self) -> None:
        self.armed = False

    def _accumulated(self, p: torch.Tensor) -> None:
        bucket = self.bucket_of.get(id(p)) if self.armed else None
        if bucket is None:  # an earlier backward of the step (or a copy's parameter)
            return
        self.ready[bucket] += 1
        while self.started < len(self.buckets) and self.ready[self.started] >= len(
            self.buckets[self.started]
        ):
            self._start()

    def _start(self) -> None:
        bucket = self.buckets[self.started]
        grads = [_grad(self.params[i]) for i in bucket]
        self.waits.append(self.comm.start_all_reduce(grads, self.group, (*self.key, self.started)))
        self.started += 1

    def finish(self) -> None:
        """Start the buckets not started yet (all of them when nothing armed this step), in
        order, and wait for every one: the gradients hold the sum over the replicas."""
        self.armed, self.early = False, self.started
        while self.started < len(self.buckets):
            self._start()
        waits, self.waits, self.started = self.waits, [], 0
        self.ready = [0] * len(self.buckets)
        for wait in waits:
            wait()


def _grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad
