"""Signs of life in the rendezvous store, so that a rank that gives up waiting names the rank
that stopped, not the peer that waits on it.

A rank waiting on rank 1, which itself waits on a stopped rank 0, times out at about the moment
rank 1 does, before rank 1's relayed error can reach it, and could only name rank 1. Every
process that runs a pipeline counts up `pdcompile/beat/<rank>` in the default group's store
every `BEAT_S` from a daemon thread; a stopped or killed process stops counting, a waiting one
does not. A rank that timed out reads every count twice, `WATCH_S` apart (`stalled`): the ranks
whose count stood still are the likely cause, and the error says so (`stall_note`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pdcompile.runtime.bounded import _default_store, store_host, within

BEAT_S = 0.5  # seconds between two beats of a process
WATCH_S = 4 * BEAT_S  # how long a rank that gave up watches the counts
_beating: dict[int, tuple[Any, threading.Thread]] = {}  # rank -> its store and thread


def start(rank: int) -> None:
    """Beat for `rank` into the default group's store until the process exits or the store
    goes (once per rank and store)."""
    store = _default_store()
    if store is None:
        return
    known = _beating.get(rank)
    if known is not None and known[0] is store and known[1].is_alive():
        return
    thread = threading.Thread(target=_beat, args=(store, rank), name="pdcompile-heartbeat",
                              daemon=True)  # fmt: skip
    _beating[rank] = (store, thread)
    thread.start()


def _beat(store: Any, rank: int) -> None:
    key = f"pdcompile/beat/{rank}"
    while _default_store() is store:  # until the group it belongs to is destroyed
        try:
            store.add(key, 1)
        except Exception:  # the store's process is gone: nobody is left to read the beats
            return
        time.sleep(BEAT_S)


def stalled(world_size: int, rank: int) -> list[int] | None:
    """The other ranks whose beats stood still for `WATCH_S` (None: the store did not answer,
    or nobody beats)."""
    store = _default_store()
    if store is None:
        return None
    keys = [f"pdcompile/beat/{r}" for r in range(world_size)]

    def counts() -> list[int]:
        return [store.add(k, 0) if store.check([k]) else -1 for k in keys]

    try:
        first = within(WATCH_S, counts)
        time.sleep(WATCH_S)
        second = within(WATCH_S, counts)
    except Exception:  # Expired, or the store's process gone
        return None
    return [r for r in range(world_size)
            if r != rank and first[r] >= 0 and second[r] == first[r]]  # fmt: skip


def stall_note(world_size: int, rank: int) -> str:
    """'; rank 0 stopped (no sign of life for 2 s): the likely cause', or '' when every other
    rank still lives (or the store cannot tell: then the rank holding it, if it is known)."""
    still = stalled(world_size, rank)
    if still is None:
        host = store_host()
        if host is None or host == rank:
            return ""
        return f"; rank {host} holds the rendezvous store, which no longer answers: it stopped"
    if not still:
        return ""
    which = ", ".join(f"rank {r}" for r in still)
    return f"; {which} stopped (no sign of life for {WATCH_S:g} s): the likely cause"
