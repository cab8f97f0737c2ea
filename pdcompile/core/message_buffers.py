"""The message buffers a rank holds: a rule of the runtime that the memory model counts.

A rank keeps its next `RECEIVES_AHEAD` receives posted (`runtime/executor.py`), so a sender's
bytes move while the receiver computes, and it frees a send's buffer once a message from the
peer shows the peer has it. So the buffers in use at once do not grow with the microbatches of
a step: per message size, the window's receives and about as many sends not yet known complete,
`IN_USE` in all (`held_bytes`; measured: `tests/test_message_buffers.py`,
`benchmarks/runtime_memory.py`). On the CPU the buffers of a size are slots of slabs of `SLOTS`
(`runtime/message_pool.py`), reused: a slab's pages are resident once a slot on them is used,
so what stays resident is the most slots of a size ever in use at once. On CUDA each message
allocates its own buffer from the caching allocator, which keeps as many.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SLOTS = 16  # buffers per slab
RECEIVES_AHEAD = 4  # receives kept posted beyond the one a rank waits for
IN_USE = 2 * RECEIVES_AHEAD  # buffers of a message size in use at once: receives and sends


def held_bytes(sizes: Iterable[int]) -> int:
    """Bytes of message buffers a rank holds for messages of `sizes` (sent or received)."""
    return IN_USE * sum({size for size in sizes if size > 0})


def stage_bytes(into: Any, out: Any) -> Any:
    """A bound on `held_bytes` of a stage alone on its ranks that receives at most `into` bytes
    a microbatch and sends at most `out` (gradients travel back at those sizes; the solvers
    pass the bytes of the edges across its two boundaries): numbers, numpy arrays or linear
    expressions alike."""
    return IN_USE * (into + out)
