"""The lease of a checkpoint name: one save (or pruning) at a time, across jobs and hosts.

A save into `<name>` holds `.<name>.lease` from its `prepare` to its `finish`: a file holding
its pid, host and start time, locked with `flock` while the save runs. Another job finds it
locked and is refused before it touches anything (it would delete the staging folder being
written, or rename another's checkpoint aside). A process that dies releases its lock with it,
so the next save takes the lease over and cleans up what the dead one left: a lease is only
taken from an owner that is provably gone. Where the filesystem has no locks, the file's
contents decide: on the same host the pid is alive, on another the lease is younger than
`STALE_S`. Torch-free.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time

from pdcompile.core.errors import CheckpointError

__all__ = ["STALE_S", "lease_path", "release", "take"]

log = logging.getLogger(__name__)

STALE_S = 6 * 3600.0  # without locks: a lease from another host older than this is gone
_HELD: dict[str, int] = {}  # lease path -> its open, locked file: this process's leases
_TRIES = 20


def lease_path(directory: str) -> str:
    """`<parent>/.<name>.lease`, beside the checkpoint `directory`."""
    parent, name = os.path.split(os.path.abspath(directory))
    return os.path.join(parent, f".{name}.lease")


def take(path: str) -> str | None:
    """Take the lease `path`; None once held, or who holds it (a live save elsewhere).

    A lease this process holds already (a save of it that never finished: saves in one process
    do not overlap) is its own again.

    Raises:
        CheckpointError: `path` is not a regular file, or keeps being replaced.
    """
    if path in _HELD:
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for _ in range(_TRIES):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _FLAGS, 0o644)
            created = True
        except FileExistsError:
            try:
                fd, created = os.open(path, os.O_RDWR | os.O_NONBLOCK | _FLAGS), False
            except FileNotFoundError:
                continue  # released meanwhile
            except OSError as exc:  # a symbolic link (O_NOFOLLOW), a folder
                why = f"cannot be opened ({exc.strerror})"
                raise CheckpointError(_not_regular(path, why)) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointError(_not_regular(path, "not a regular file"))
            locked = _lock(fd)
            if locked is False or (locked is None and not created and _alive(fd)):
                return _owner(fd)
            if not _current(fd, path):
                continue  # released and replaced between our open and our lock: again
            _stamp(fd)
            _HELD[path], fd = fd, -1
            return None
        finally:
            if fd >= 0:
                os.close(fd)
    raise CheckpointError(_not_regular(path, f"replaced {_TRIES} times while it was taken"))


def release(path: str) -> None:
    """Give the lease `path` back (deleted); nothing when this process does not hold it."""
    fd = _HELD.pop(path, None)
    if fd is None:
        return
    try:
        if _current(fd, path):
            os.unlink(path)  # before the lock goes: a waiter then finds its file replaced
    except OSError as exc:
        log.warning("cannot delete %s (%s): the next save takes it over", path, exc)
    finally:
        os.close(fd)


_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _lock(fd: int) -> bool | None:
    """Lock `fd`: True, False when another holds it, None where the filesystem has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        return None  # ENOLCK, EINVAL, EOPNOTSUPP: no locks here


def _alive(fd: int) -> bool:
    """Without locks: whether the lease's owner may still be saving (its pid, or its age)."""
    doc = _read(fd)
    if doc.get("host") == socket.gethostname() and isinstance(doc.get("pid"), int):
        try:
            os.kill(doc["pid"], 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True  # another user's process
        return True
    return time.time() - os.fstat(fd).st_mtime < STALE_S


def _owner(fd: int) -> str:
    doc = _read(fd)
    since = doc.get("time")
    age = f", for {time.time() - since:.0f} s" if isinstance(since, int | float) else ""
    return f"pid {doc.get('pid', '?')} on host {doc.get('host', '?')}{age}"


def _read(fd: int) -> dict:
    try:
        doc = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _stamp(fd: int) -> None:
    doc = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
    data = json.dumps(doc).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _current(fd: int, path: str) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        now, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _not_regular(path: str, what: str) -> str:
    return (
        f"{path}, which saves into {os.path.basename(path)[1:-6]} hold while they run, is {what}: "
        "move it away, or save into another folder"
    )
