"""Read a file only if it is a regular file: a FIFO blocks its reader until a writer comes (forever,
for a plan or cache path someone replaced with one), and a device can be endless. Torch-free.

Every loader of a user-given or cached path (`Plan.load`, `CostGraph.load`,
`CostGraph.from_pipedream`, traces, torch schedule CSVs, `StagedProgram.load`, the profile,
calibration, optimizer-step and cluster caches) reads through
`read_regular_text`; a path that is not a regular file raises `NotRegularFile`, an `OSError`, so
each loader's own handling of unreadable files names it (a named error, or a cache ignored).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["NotRegularFile", "open_regular", "read_regular_text"]

_KINDS = {
    stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket",
}  # fmt: skip


class NotRegularFile(OSError):
    """The path exists but is no regular file (its `strerror` says what it is)."""


def open_regular(path: str | os.PathLike) -> int:
    """A read-only descriptor of `path` if it is a regular file (after symlinks). Opened without
    blocking, then checked, so a FIFO swapped in after any earlier check cannot block either.

    Raises:
        FileNotFoundError: no such file.
        NotRegularFile: a FIFO, a device, a folder or a socket: not read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    raise NotRegularFile(
        errno.EINVAL, f"it is {kind}, not a regular file: not read (give a file's path)", str(path)
    )


def read_regular_text(path: str | os.PathLike, encoding: str = "utf-8") -> str:
    """The text of `path`, a regular file (`open_regular`).

    Raises:
        OSError: no such file, it cannot be read, or `NotRegularFile`.
        UnicodeDecodeError: it is not text in `encoding`.
    """
    with os.fdopen(open_regular(Path(path)), "rb") as file:
        return file.read().decode(encoding)
