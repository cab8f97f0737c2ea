"""Freed host memory goes back to the system: glibc's malloc serves large blocks from their own
mappings, at a fixed threshold.

glibc maps a block of 128 KiB or more on its own, and when such a block is freed it raises
that threshold to the block's size (up to 32 MiB): after the first 4 MiB weight-gradient
temporary of a backward is freed, every later one comes from the heap, whose holes a live
message or activation pins, and the resident set grows. 4 ranks of an MLP(1024) x 8, 64
microbatches of 16 rows (`benchmarks/runtime_memory.py`): the middle ranks' peak RSS grew by
98 MiB where the plan says 24 MiB; with the threshold fixed at `MMAP_FLOOR` (which turns
glibc's moving threshold off), by 42 MiB, at the same step time. A pipeline rank on the CPU
(`DistributedComm`) asks for it once per process (`return_freed_memory`).

Left as they are: a C library other than glibc, and a process whose environment sets glibc's
own `MALLOC_MMAP_THRESHOLD_` or a `malloc.mmap_threshold` tunable (the user's choice stands).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_FLOOR = 256 * 1024  # bytes: blocks this large are mapped on their own, and unmapped freed
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
ENABLED = True  # benchmarks/runtime_memory.py --glibc-default turns it off to compare
_asked: bool | None = None


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at `MMAP_FLOOR` in this process (once); whether it is set."""
    global _asked
    if _asked is None:
        _asked = ENABLED and not _users_choice() and _mallopt(_M_MMAP_THRESHOLD, MMAP_FLOOR)
    return _asked


def _users_choice() -> bool:
    return "MALLOC_MMAP_THRESHOLD_" in os.environ or "malloc.mmap_threshold" in os.environ.get(
        "GLIBC_TUNABLES", ""
    )


def _mallopt(parameter: int, value: int) -> bool:
    """glibc's `mallopt`; False where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        return bool(libc.mallopt(ctypes.c_int(parameter), ctypes.c_int(value)))
    except (OSError, AttributeError):
        return False
