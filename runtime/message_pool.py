"""Message buffers on the CPU, carved from slabs and reused: what the runtime holds stays bounded.

Each message of a size, sent or received, used to be a fresh `torch.empty` of about 64 KiB.
glibc places such buffers in the holes the weight gradients' multi-MiB temporaries leave on
its heap, and a buffer still held pins its hole, so the heap grows: 4 ranks of an
MLP(1024) x 8 at 64 microbatches of 16 rows grew by 218-262 MiB on the middle ranks where
the plan said 24 MiB (`benchmarks/runtime_memory.py`). Here the buffers of a size are slots
of slabs allocated `SLOTS` at a time (one allocation each, out of the heap's holes) and given
back when the message is done with: a send once it completed, a receive once its values were
copied out (the stage keeps them; a slot it kept would be overwritten by a later message). The
pool holds at most as many slots as were in use at once, rounded up to a slab, and of a slab
only the pages of slots once used are resident: what the memory model counts
(`pdcompile/core/message_buffers.py`, docs/memory.md).
"""

from __future__ import annotations

import torch

from pdcompile.core.message_buffers import SLOTS


class MessagePool:
    """Reusable uint8 buffers by size, on the CPU."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lent: dict[int, torch.Tensor] = {}  # id -> buffer, to tell the pool's own apart

    def take(self, size: int) -> torch.Tensor:
        """A buffer of `size` bytes (its contents undefined)."""
        free = self._free.setdefault(size, [])
        if not free:
            slab = torch.empty(SLOTS * size, dtype=torch.uint8)
            free.extend(slab[i * size : (i + 1) * size] for i in reversed(range(SLOTS)))
        buffer = free.pop()
        self._lent[id(buffer)] = buffer
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """Take back a buffer `take` gave once nothing reads or writes it (others are ignored)."""
        if self._lent.pop(id(buffer), None) is not None:
            self._free[buffer.numel()].append(buffer)

    @property
    def held_bytes(self) -> int:
        """Bytes of the slabs allocated (free and lent slots)."""
        lent = sum(b.numel() for b in self._lent.values())
        return lent + sum(b.numel() for free in self._free.values() for b in free)
