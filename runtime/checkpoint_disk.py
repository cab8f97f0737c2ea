"""A failed checkpoint write told apart: a full disk (or quota) is named as such.

torch's zip writer hides the errno of a full disk (`unexpected pos 704 vs 598`), and the other
ranks' failures reach a rank as text; so a failure is from a full disk when its chain holds an
`OSError` with `ENOSPC` or `EDQUOT`, its text says so, or the folder's free space is below
what this rank was writing. Torch-free.
"""

from __future__ import annotations

import errno
import os
import shutil

__all__ = ["disk_full"]

_FULL = (errno.ENOSPC, errno.EDQUOT)
_WORDS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), "[Errno 28]", "[Errno 122]")


def disk_full(path: str, exc: BaseException, needed: int) -> str | None:
    """'the disk holding <folder> is full (<free> free, ...)' when the failure `exc` of a save
    into `path` comes from a full disk, else None. `needed`: the bytes this rank writes."""
    folder = os.path.dirname(os.path.abspath(path)) or os.sep
    try:
        free: int | None = shutil.disk_usage(folder).free
    except OSError:
        free = None
    if not (_no_space(exc) or (free is not None and free < needed)):
        return None
    left = "an unknown amount" if free is None else _size(free)
    return (
        f"the disk holding {folder} is full ({left} free; this rank writes about "
        f"{_size(needed)}): free space there or save elsewhere; the unfinished save was removed"
    )


def _no_space(exc: BaseException) -> bool:
    """Whether `exc`, its causes or the rank failures it carries say the disk is full."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        error = todo.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _FULL:
            return True
        if any(word in str(error) for word in _WORDS):
            return True
        failures = getattr(error, "failures", None)  # DCP's CheckpointException: every rank's
        if isinstance(failures, dict):
            todo += [f[0] for f in failures.values() if isinstance(f, tuple) and f]
        todo += [e for e in (error.__cause__, error.__context__) if e is not None]
    return False


def _size(count: int) -> str:
    value, unit = float(count), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{count} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
