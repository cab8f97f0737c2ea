"""Bounded waits outside the step machinery: start-up collectives, the loaded profile's signal,
the executor's process groups, the closed loop's decision, the automatic resume's listing.

A collective of every rank (`collective`) runs in a helper thread under a deadline: gloo bounds
its own operations by the group's timeout, but not the store they meet through (`new_group`,
the loaded profile's signal), and a `TCPStore` lives in rank 0's process when no torchrun agent
holds it, so a stopped rank 0 blocks its clients forever. Before it runs, each rank marks its
arrival in the store (`pdcompile/arrived/<tag>/<n>/<rank>`), so a rank that gives up names the
ranks that never arrived; one whose store no longer answers names the rank holding it. A thread
left waiting is a daemon: the process still exits (the run is failing already).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from pdcompile.core.errors import PipelineTimeoutError

__all__ = ["collective", "store_host", "within"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_PREFIX = "pdcompile/arrived"
LOOK_S = 2.0  # how long a rank that gave up looks in the store for who never arrived
_ROUNDS: defaultdict[str, itertools.count] = defaultdict(itertools.count)  # per tag, same order


class Expired(Exception):
    """`within` ran out of time (the thread goes on waiting, abandoned)."""


def within(seconds: float, run: Callable[[], T], name: str = "pdcompile-bounded") -> T:
    """`run()`'s result, or its exception, if it ends within `seconds`.

    Raises:
        Expired: it did not (it goes on in a daemon thread, whose result is dropped).
    """
    box: dict[str, Any] = {}
    # the current CUDA device is per thread (NCCL and object collectives use it)
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def target() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            box["value"] = run()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(max(0.0, seconds))
    if thread.is_alive():
        raise Expired(f"still waiting after {seconds:.1f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def store_host() -> int | None:
    """The rank whose process holds the default group's store: 0 for a `TCPStore` rank 0
    started (no torchrun agent); None for a `FileStore` or torchrun's agent."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    store = _default_store()
    while store is not None and hasattr(store, "underlying_store"):  # a PrefixStore
        store = store.underlying_store
    return 0 if isinstance(store, dist.TCPStore) else None


def collective(
    rank: int,
    what: str,
    run: Callable[[], T],
    timeout_s: float,
    tag: str | None = None,
    culprit: str = "runs other code",
) -> T:
    """Run `run` (a collective every rank calls with the same `tag`, in the same order) for at
    most `timeout_s`, and return what it returns.

    Args:
        what: what this rank does, for the message ("receiving the plan from rank 0").
        tag: what every rank calls it (default: `what`).
        culprit: what else a rank that never arrived may have done ("did not call
            pdcompile.compile"), beside dying or hanging.

    Raises:
        PipelineTimeoutError: it ran past `timeout_s` or the backend failed (a dead peer),
            naming the ranks that never arrived, else the rank holding an unanswering store,
            else the rank a backend message names, else "another rank".
    """
    if not (dist.is_available() and dist.is_initialized()):
        return run()
    key = f"{_PREFIX}/{tag or what}/{next(_ROUNDS[tag or what])}"
    store = _default_store()

    def arrive_and_run() -> T:
        if store is not None:
            store.set(f"{key}/{rank}", "1")
        return run()

    start = time.monotonic()
    try:
        return within(timeout_s, arrive_and_run, f"pdcompile {what}")
    except (Expired, RuntimeError) as exc:
        waited = time.monotonic() - start
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        reason = "" if isinstance(exc, Expired) else lines[0]
        who = _at_fault(rank, key, reason, culprit, patient=not isinstance(exc, Expired))
        log.error("rank %d gave up %s after %.1f s: %s", rank, what, waited, who)
        raise PipelineTimeoutError(
            f"rank {rank} gave up {what} after waiting {waited:.1f} s (timeout "
            f"{round(timeout_s, 1):g} s): {who}" + (f" ({reason})" if reason else "") + "; that "
            "rank's own log says why: restart the job (from its last checkpoint)"
        ) from exc


def _at_fault(rank: int, key: str, reason: str, culprit: str, patient: bool) -> str:
    """Who the wait of `key` waited for, in words (`patient`: it failed early, so a slower rank
    may still arrive)."""
    world_size = dist.get_world_size()
    absent = _absent(key, world_size, LOOK_S if patient else 0.0)
    host = store_host()
    if absent == "gone" and host is not None and rank != host:
        return (f"rank {host} exited (its process held the rendezvous store, now gone; it may "
                "have stopped after another rank failed: its log says)")  # fmt: skip
    if absent == "gone":
        absent = None
    if absent:
        absent = [r for r in absent if r != rank]
        if absent:
            names = f"rank {absent[0]}" if len(absent) == 1 else f"ranks {absent}"
            return f"{names} never arrived (died, hangs, or {culprit})"
    elif absent is None and host is not None and rank != host:
        return (f"rank {host} hangs (its process holds the rendezvous store, which no longer "
                "answers)")  # fmt: skip
    named = sorted({int(r) for r in re.findall(r"\brank (\d+)", reason)} - {rank})
    if len(named) == 1:
        return f"rank {named[0]} died or hangs"
    return "another rank died or hangs"


def _absent(key: str, world_size: int, patience_s: float) -> list[int] | str | None:
    """The ranks whose arrival at `key` the store lacks, looked at again for up to `patience_s`
    while some are missing; None when the store does not answer within `LOOK_S`, "gone" when it
    fails (its process exited)."""
    store = _default_store()
    if store is None:
        return []
    deadline = time.monotonic() + patience_s
    absent: list[int] | None = None
    while True:
        left = max(deadline - time.monotonic(), LOOK_S if absent is None else 0.0)
        try:
            absent = within(left, lambda: [r for r in range(world_size)
                                           if not store.check([f"{key}/{r}"])])  # fmt: skip
        except Expired:
            return absent
        except Exception:  # the store's connection: its process is gone
            return absent if absent is not None else "gone"
        if not absent or time.monotonic() + 0.2 > deadline:
            return absent
        time.sleep(0.2)


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
