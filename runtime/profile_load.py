"""The run's conditions for `compile`'s profile: while rank 0 measures, the other ranks on its
machine train the model on the example, as they will train their stages in the run.

Ranks on one machine share its caches, memory bandwidth and cores (under a hypervisor maybe
more), so a profile taken on an otherwise idle machine prices a step short. On the 2-core VM of
docs/simulator.md (2 gloo ranks, one thread each), rank 0's profile taken alone predicted the
zoo's GPT at 0.57-0.58 of its measured step, and taken while rank 1 trained, at 0.86-0.94.

Every rank calls `ProfileLoad(rank, world_size, active)`, with `active` the same on all (when
it is, a collective: the ranks exchange their host names); rank 0 profiles inside
`load.profiling()`, which yields how many ranks load it and tells them to stop when it ends,
even on an error; the others call `load.serve(step, timeout_s)`. An inactive load has no
loading ranks: both return at once. The signal goes through the process group's store, so the
loading ranks never block in a collective rank 0 is not in; a helper thread watches for it, so
a store that stops answering (it lives in rank 0's process without torchrun) never blocks them
past `timeout_s` either.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from pdcompile.runtime.bounded import collective

logger = logging.getLogger(__name__)

_ROUNDS = itertools.count()  # every rank makes its ProfileLoads in the same order
_PREFIX = "pdcompile/profiled"


class ProfileLoad:
    """Which ranks load rank 0's machine while it profiles, and the signal that stops them."""

    def __init__(
        self, rank: int, world_size: int, active: bool = True, timeout_s: float = 900.0
    ) -> None:
        self.rank, self.loaders, self._key = rank, [], ""
        if active:
            hosts: list[str | None] = [None] * world_size
            collective(rank, "sharing host names for the loaded profile",
                       lambda: dist.all_gather_object(hosts, socket.gethostname()), timeout_s,
                       culprit="did not call pdcompile.compile")  # fmt: skip
            self.loaders = [r for r in range(1, world_size) if hosts[r] == hosts[0]]
            self._key = f"{_PREFIX}/{next(_ROUNDS)}"

    @contextmanager
    def profiling(self) -> Iterator[int]:
        """Rank 0's: yields how many other ranks train meanwhile; stops them when it ends."""
        try:
            yield len(self.loaders)
        finally:
            if self.loaders:
                dist.distributed_c10d._get_default_store().set(self._key, "done")

    def serve(self, step: Callable[[], None], timeout_s: float) -> bool:
        """A loading rank's: run `step` until rank 0 is done profiling; whether its signal
        ended the load. The load is best effort: after `timeout_s`, or when the store or `step`
        fails (logged), the rank goes on to receive the plan, whose broadcast reports a rank 0
        that never sends it (within what is left of the same timeout: compile). Ranks that do
        not load return False at once."""
        if self.rank not in self.loaders:
            return False
        store = dist.distributed_c10d._get_default_store()
        deadline = time.monotonic() + timeout_s
        done, failed = threading.Event(), []

        def watch() -> None:  # a thread: the store may block (held by a stopped rank 0)
            try:
                while time.monotonic() < deadline:
                    if store.check([self._key]):
                        done.set()
                        return
                    time.sleep(0.01)
            except Exception as exc:
                failed.append(exc)

        threading.Thread(target=watch, name="pdcompile profile signal", daemon=True).start()
        try:
            while not done.is_set() and not failed and time.monotonic() < deadline:
                step()
        except Exception as exc:  # a load that fails only ends the load
            logger.warning("rank %d stopped training while rank 0 profiles: %s", self.rank, exc)
            return False
        if failed:
            logger.warning("rank %d stopped training while rank 0 profiles: %s", self.rank,
                           failed[0])  # fmt: skip
        return done.is_set()


def example_step(
    model: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    targets: Any,
) -> Callable[[], None]:
    """A forward and backward of `model` on the example that changes nothing of it: buffers
    cloned (batch norm's statistics stay), gradients returned rather than accumulated, and the
    random generators restored (dropout's masks in the run stay those of a run without it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    devices = sorted({str(p.device) for p in params if p.device.type == "cuda"})

    def step() -> None:
        with torch.random.fork_rng(devices=devices):
            buffers = {name: b.clone() for name, b in model.named_buffers()}
            out = torch.func.functional_call(model, buffers, inputs, dict(kwargs or {}))
            if loss_fn is not None and targets is not None:
                loss = loss_fn(out, targets)
            else:
                leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
                loss = sum(t.float().mean() for t in leaves if t.requires_grad)
            if isinstance(loss, torch.Tensor) and loss.requires_grad and params:
                torch.autograd.grad(loss, params, allow_unused=True)

    return step
