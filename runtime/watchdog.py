"""The comm's watchdog: a thread that, while one of a `DistributedComm`'s waits lasts, logs every
`watchdog_s` which rank waits, on what, with whom and for how long, so that a hang shows in the
log long before the timeout. It holds the comm weakly and ends with it, or when it is closed."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

logger = logging.getLogger("pdcompile.runtime.distributed")  # beside the comm's own records


def start_watchdog(comm: Any) -> threading.Thread:
    """Start the watchdog of `comm` (a `DistributedComm`: its `rank`, `timeout_s`,
    `watchdog_s`, the wait in progress `_waiting` and the `_closed` event)."""
    thread = threading.Thread(target=_watch, args=(weakref.ref(comm),), name="watchdog",
                              daemon=True)  # fmt: skip
    thread.start()
    return thread


def peers(peer: Any) -> str:
    """'rank 1', or 'ranks [0, 1]' for a group."""
    return f"ranks {list(peer)}" if isinstance(peer, tuple) else f"rank {peer}"


def _watch(ref: weakref.ref) -> None:
    reported: tuple[tuple[str, Any, float] | None, float] = (None, 0.0)  # wait, seconds
    while (comm := ref()) is not None:
        tick, waiting = comm.watchdog_s, comm._waiting
        if waiting is not None:
            what, peer, since = waiting
            waited = time.monotonic() - since
            last = reported[1] if reported[0] is waiting else 0.0
            if waited - last >= tick:
                logger.warning(
                    "rank %d has waited %.0f s %s with %s (it gives up after %g s)",
                    comm.rank, waited, what, peers(peer), comm.timeout_s,
                )  # fmt: skip
                reported = (waiting, waited)
        closed = comm._closed
        del comm
        if closed.wait(tick / 4):
            return
