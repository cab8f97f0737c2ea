"""The ranks of one checkpoint save or load: their group, its waits watched and bounded.

A save or load waits for the other ranks in gathers and in DCP's collectives. Given the step
`timeout` (`PipelinedModule.save` and `load` pass `compile(timeout=...)`), they run in a gloo
group of their own, created with that timeout and destroyed after: the default group's timeout
is the start-up's (`startup_timeout`, 900 s). While a wait lasts, a watchdog logs the warning a
stuck step gets; a timeout or a dead peer becomes `PipelineTimeoutError` on every rank that
waits, naming the checkpoint, the phase, the rank that stopped (a process running a pipeline
counts up signs of life in the store, `runtime/heartbeat.py`: a collective's own error names no
rank) and what became of the checkpoint (docs/checkpoints.md, "Stuck and dead ranks").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pdcompile.core.errors import CheckpointError, PdcompileError, PipelineTimeoutError

__all__ = ["Ranks", "local", "ranks_of"]

log = logging.getLogger(__name__)


def local() -> bool:
    """No process group: save and load are local (DCP's `no_dist`)."""
    return not (dist.is_available() and dist.is_initialized())


class Ranks:
    """The ranks of one save or load: their group, and its waits watched (a warning every
    `timeout_s / 5` seconds, as a stuck step's) and their failures named."""

    def __init__(self, path: str, verb: str, group: Any, timeout_s: float | None) -> None:
        self.path, self.verb, self.group, self.timeout_s = path, verb, group, timeout_s
        self.local = local()
        # the default group's ranks (also a group `ranks_of` makes of them), numbered as the
        # signs of life in its store (`runtime/heartbeat.py`): a failure names who stopped
        self.numbered = group is None and not self.local
        self.rank = 0 if self.local else dist.get_rank(group)
        self.world_size = 1 if self.local else dist.get_world_size(group)

    def gather(self, value: Any, what: str, outcome: str = "") -> list[Any]:
        """Every rank's `value`, by rank (this rank's alone when local)."""
        if self.local:
            return [value]
        with self.phase(what, outcome):
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, value, group=self.group)
            return out

    @contextlib.contextmanager
    def phase(self, what: str, outcome: str = "") -> Iterator[None]:
        """Around waits for the other ranks: a watchdog while they last; a timeout or a dead
        peer (the backend's RuntimeError) becomes `PipelineTimeoutError`, saying `outcome`."""
        if self.local:
            yield
            return
        doing = f"{self.verb} checkpoint {self.path} ({what})"
        peers = [r for r in range(self.world_size) if r != self.rank]
        bound = "the group's timeout" if self.timeout_s is None else f"timeout {self.timeout_s:g} s"
        start, stop = time.monotonic(), threading.Event()
        threading.Thread(target=_watch, args=(stop, self.rank, doing, peers, self.timeout_s),
                         name="checkpoint-watchdog", daemon=True).start()  # fmt: skip
        try:
            yield
        except RuntimeError as exc:
            if isinstance(exc, PdcompileError):
                raise
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            waited = time.monotonic() - start
            if self.numbered:  # gloo names no rank for a collective: who stopped beating?
                from pdcompile.runtime import heartbeat

                reason += heartbeat.stall_note(self.world_size, self.rank)
            log.error("rank %d: %s with ranks %s failed after %.1f s: %s", self.rank, doing,
                      peers, waited, reason)  # fmt: skip
            default = (
                f"the checkpoint in {self.path} is unchanged"
                if self.verb == "saving"
                else "nothing was loaded"
            )
            raise PipelineTimeoutError(
                f"rank {self.rank} gave up {doing} with ranks {peers} after {waited:.1f} s "
                f"({bound}): {reason}; a rank died or hangs: see its own log; "
                f"{outcome or default}"
            ) from exc
        finally:
            stop.set()


def _watch(
    stop: threading.Event, rank: int, doing: str, peers: list[int], timeout_s: float | None
) -> None:
    """The watchdog of one phase: until `stop`, log every tick how long this rank has waited."""
    tick = 60.0 if timeout_s is None else min(60.0, max(1.0, timeout_s / 5))
    limit = "the group's timeout" if timeout_s is None else f"{timeout_s:g} s"
    start = time.monotonic()
    while not stop.wait(tick):
        log.warning("rank %d has waited %.0f s %s with ranks %s (it gives up after %s)",
                    rank, time.monotonic() - start, doing, peers, limit)  # fmt: skip


@contextlib.contextmanager
def ranks_of(path: str, verb: str, group: Any, timeout_s: float | None) -> Iterator[Ranks]:
    """The ranks of a save or load; with `timeout_s`, in a gloo group of their own bounded by
    it (the default group's timeout is the start-up's), destroyed after."""
    ranks = Ranks(path, verb, group, None if group is not None else timeout_s)
    if group is not None and timeout_s is not None:
        raise CheckpointError(
            f"checkpoint {path}: {verb} with both process_group and timeout_s={timeout_s:g}: a "
            "group's own timeout bounds its waits; pass one of them (create the group with "
            "dist.new_group(timeout=...))"
        )
    if ranks.local or timeout_s is None:
        yield ranks
        return
    from pdcompile.runtime.bounded import collective

    with ranks.phase("meeting the other ranks"):  # through the store, which gloo does not bound
        ranks.group = collective(
            ranks.rank, f"{verb} checkpoint {path} (meeting the other ranks)",
            lambda: dist.new_group(timeout=timedelta(seconds=timeout_s), backend="gloo"),
            timeout_s, "checkpoint group", culprit=f"did not start {verb} it",
        )  # fmt: skip
    try:
        yield ranks
    finally:
        dist.destroy_process_group(ranks.group)
