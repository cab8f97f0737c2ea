"""A checkpoint's `manifest.json` (checksums of every file) and its atomic replacement on disk.

A save writes into a staging folder beside the target, `.<name>.tmp-<token>`; rank 0 then writes
`manifest.json` (the size and SHA-256 of every other file, the step, what the checkpoint holds)
and `commit` puts the folder in place: the previous checkpoint is renamed to `.<name>.old-<token>`,
the new one to `<name>`, and `finish` deletes the old one. Before anything is created, `prepare`
records the token in the journal `.<name>.journal`: what interrupted saves left is found there,
by exact name, never by a pattern that another checkpoint's name could match. A process killed at
any point leaves the previous checkpoint or the new one, whole (docs/checkpoints.md, "Atomic
saves"). Readers check the manifest and the checksums before opening any file (DCP's `.metadata`
is a pickle), and open regular files only: a FIFO or a device never blocks a load. Torch-free.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Mapping
from typing import Any

from pdcompile.core.errors import CheckpointError
from pdcompile.runtime import manifest_lease as lease
from pdcompile.runtime.manifest_format import FORMAT, MANIFEST, VERSION, Manifest

__all__ = [
    "FORMAT", "MANIFEST", "VERSION", "Manifest", "abandon", "commit", "finish", "hashes",
    "prepare", "read", "remove", "staging_path", "verify",
]  # fmt: skip

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_MANIFEST_MAX = 64 << 20  # bytes: a manifest of 10^5 files and names is a few MiB
_JOURNAL = "pdcompile.save-journal"
_TOKEN = re.compile(r"[0-9a-f]{8}")
_SUFFIX = len("." + ".tmp-") + 8  # what a staging folder's name adds to the checkpoint's
_KINDS = {
    stat.S_IFREG: "a regular file", stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket",
}  # fmt: skip
# what a folder may hold for a save to replace it: a checkpoint's own files
_REPLACEABLE = (MANIFEST, ".metadata", "*.distcp")


def read(directory: str) -> Manifest:
    """The manifest of the checkpoint in `directory` (no other file is opened).

    Raises:
        CheckpointError: no such folder (saying what an interrupted save left beside it), no
            manifest (a torch.distributed.checkpoint folder, or not a checkpoint), a manifest
            that is not a regular file, or a malformed one.
    """
    where = f"checkpoint {directory}"
    if not os.path.isdir(directory):
        raise CheckpointError(f"{where}: not a checkpoint: {_missing(directory)}")
    try:
        data = read_regular(os.path.join(directory, MANIFEST), _MANIFEST_MAX)
    except FileNotFoundError:
        if os.path.lexists(os.path.join(directory, ".metadata")):
            raise CheckpointError(
                f"{where}: a torch.distributed.checkpoint directory without pdcompile's "
                f"{MANIFEST}: not opened, since its metadata is a pickle and only checkpoints "
                "whose checksums verify are read; if you trust it, read it with "
                "torch.distributed.checkpoint.load"
            ) from None
        raise CheckpointError(
            f"{where}: not a checkpoint: no {MANIFEST}; the path is wrong or a save did not finish"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot read {MANIFEST}: {exc}") from None
    except CheckpointError as exc:  # not a regular file, or too large
        raise CheckpointError(f"{where}: {exc}; the folder was altered: load an earlier "
                              "checkpoint") from None  # fmt: skip
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{where}: cannot read {MANIFEST}: {exc}") from None
    return Manifest.from_json(text, f"{where}: {MANIFEST}")


def read_regular(path: str, limit: int) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes; nothing else is opened (a
    FIFO would block, a device could be endless).

    Raises:
        OSError: no such file, or it cannot be read.
        CheckpointError: it is not a regular file (saying what it is), or larger.
    """
    with _open_regular(path) as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(
            f"{os.path.basename(path)} is over {limit} bytes, more than pdcompile writes there"
        )
    return data


def verify(directory: str, manifest: Manifest, share: int = 0, num_shares: int = 1) -> list[str]:
    """Problems with the files of `directory` against its manifest (empty: it verifies).

    Share `share` of `num_shares` checks every `num_shares`-th listed file (ranks split the
    hashing); share 0 also reports files the manifest does not list.
    """
    problems = []
    names = sorted(manifest.files)
    if share == 0:
        try:
            present = sorted(os.listdir(directory))
        except OSError as exc:
            return [f"the folder cannot be listed ({exc.strerror})"]
        listed = set(names) | {MANIFEST}
        problems += [
            f"{name} is in the folder but not in {MANIFEST}: a file was added or the folder "
            "mixes two saves; not opened"
            for name in present
            if name not in listed
        ]
    for name in names[share::num_shares]:
        size, digest = manifest.files[name]
        path = os.path.join(directory, name)
        try:
            info = os.stat(path)  # a symlink's target: its contents are checked
            kind, found = _kind(info.st_mode), info.st_size
            if kind != "a regular file":
                problems.append(
                    f"{name} is {kind}, not a regular file: not opened; the folder was altered, "
                    "load an earlier checkpoint"
                )
            elif found != size:
                problems.append(
                    f"{name} is {found} bytes but {MANIFEST} records {size}: the file is "
                    "truncated or altered; not opened, load an earlier checkpoint"
                )
            elif sha256(path) != digest:
                problems.append(
                    f"{name} does not match its SHA-256 in {MANIFEST}: the file is altered or "
                    "corrupt; not opened, load an earlier checkpoint"
                )
        except OSError as exc:
            problems.append(f"{name}, which {MANIFEST} lists, cannot be read ({exc.strerror})")
        except CheckpointError as exc:  # made a FIFO since the check above
            problems.append(f"{exc}; the folder was altered, load an earlier checkpoint")
    return problems


def write(directory: str, manifest: Manifest) -> None:
    """Write `manifest` as `directory/manifest.json`, flushed to disk."""
    path = os.path.join(directory, MANIFEST)
    with open(path, "w", encoding="utf-8") as file:
        file.write(manifest.to_json())
        file.flush()
        os.fsync(file.fileno())


def describe(directory: str, world_size: int, holds: Mapping[str, Any]) -> Manifest:
    """A manifest of the files now in `directory` (sizes and SHA-256s), with what it holds."""
    names = [name for name in os.listdir(directory) if name != MANIFEST]
    return Manifest(files=hashes(directory, names), world_size=world_size, **holds)


def hashes(directory: str, names: list[str]) -> dict[str, tuple[int, str]]:
    """The size and SHA-256 of each of `names` in `directory` (a rank's share of a save's)."""
    files = {}
    for name in sorted(names):
        path = os.path.join(directory, name)
        files[name] = (os.path.getsize(path), sha256(path))
    return files


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with _open_regular(path) as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def staging_path(directory: str, token: str, kind: str = "tmp") -> str:
    """`<parent>/.<name>.<kind>-<token>`: where a save writes (`tmp`) or the old one waits."""
    parent, name = os.path.split(os.path.abspath(directory))
    return os.path.join(parent, f".{name}.{kind}-{token}")


def prepare(directory: str, token: str | None = None) -> list[str]:
    """Before a save into `directory`: refuse to replace a folder that is not a checkpoint, or
    one another live save is writing (its lease, `runtime/manifest_lease.py`); restore a
    previous checkpoint that a save killed between its two renames left aside, delete what
    interrupted saves recorded, and record `token`, the save's (when given: the lease is then
    held until `finish` or `abandon`). Returns the problems (empty: go ahead)."""
    if problems := _refusals(directory):
        return problems
    held = lease.lease_path(directory)
    if who := lease.take(held):
        return [
            f"another save into it is under way ({who}, holding {held}): two jobs are saving "
            "into one checkpoint name; give each job its own folder (checkpoint_dir), or wait "
            "for that save to end"
        ]
    try:
        problems = _prepare(directory, token)
    except BaseException:
        lease.release(held)
        raise
    if token is None or problems:
        lease.release(held)
    return problems


def _prepare(directory: str, token: str | None) -> list[str]:
    """`prepare`, the lease held."""
    if token is not None and any(
        os.path.lexists(staging_path(directory, token, kind)) for kind in ("tmp", "old")
    ):
        return [f"{staging_path(directory, token)} exists already: save again (another token)"]
    tokens = _recorded(directory)
    previous = _previous(directory, tokens)
    if previous and not os.path.lexists(directory):
        log.warning("restoring %s from %s (a save was cut short)", directory, previous)
        os.rename(previous, directory)
    for left in tokens:
        for kind in ("tmp", "old"):
            shutil.rmtree(staging_path(directory, left, kind), ignore_errors=True)
    kept = [t for t in tokens if _left(directory, t)]  # what could not be deleted stays recorded
    _record(directory, kept + ([token] if token is not None else []))
    return []


def commit(staging: str, directory: str, token: str) -> None:
    """Put the complete checkpoint `staging` in place of `directory` (see the module doc)."""
    _fsync_dir(os.path.dirname(os.path.abspath(directory)))  # the journal, before any rename
    if os.path.lexists(directory):
        os.rename(directory, staging_path(directory, token, "old"))
    os.rename(staging, directory)
    _fsync_dir(os.path.dirname(os.path.abspath(directory)))


def finish(directory: str, token: str) -> None:
    """After a commit, or a save refused before it wrote a file: delete the previous checkpoint
    and the save's record, and give its lease back (best effort: what is left stays recorded,
    and the next save into `directory` deletes it)."""
    old = staging_path(directory, token, "old")
    try:
        if os.path.lexists(old):
            shutil.rmtree(old)
        _record(directory, [t for t in _recorded(directory) if t != token or _left(directory, t)])
    except OSError as exc:
        log.warning("%s: cannot delete %s (%s): the next save into it does", directory, old, exc)
    finally:
        lease.release(lease.lease_path(directory))


def abandon(directory: str, token: str) -> None:
    """After a save that failed before its commit ended: put the previous checkpoint back if
    the commit had moved it aside, delete the staging folder, then `finish` (best effort)."""
    tmp, old = staging_path(directory, token), staging_path(directory, token, "old")
    try:
        if os.path.lexists(old) and not os.path.lexists(directory):
            os.rename(old, directory)
        shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        log.warning("%s: cannot put back %s (%s): the next save into it does", directory, old, exc)
    finish(directory, token)


def remove(directory: str) -> bool:
    """Delete the checkpoint `directory`, what interrupted saves into it left, its journal and
    lease; False (nothing deleted) while a live save into it holds the lease."""
    held = lease.lease_path(directory)
    try:
        if who := lease.take(held):
            log.info("not deleting %s: a save into it is under way (%s)", directory, who)
            return False
    except CheckpointError as exc:
        log.warning("not deleting %s: %s", directory, exc)
        return False
    try:
        for token in _recorded(directory):
            for kind in ("tmp", "old"):
                shutil.rmtree(staging_path(directory, token, kind), ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)
        _record(directory, [t for t in _recorded(directory) if _left(directory, t)])
    except OSError as exc:
        log.warning("%s: cannot delete its journal (%s)", directory, exc)
    finally:
        lease.release(held)
    return True


def _refusals(directory: str) -> list[str]:
    """Why a save must not replace `directory`, or write beside it."""
    parent, name = os.path.split(os.path.abspath(directory))
    try:
        longest = os.pathconf(parent, "PC_NAME_MAX") if os.path.isdir(parent) else 255
    except (OSError, ValueError):
        longest = 255
    if len(os.fsencode(name)) + _SUFFIX > longest:
        return [
            f"the name {name!r} is {len(os.fsencode(name))} bytes: a save writes beside it into "
            f"a folder named {_SUFFIX} bytes longer, past this filesystem's {longest}; choose a "
            "shorter name"
        ]
    if os.path.lexists(directory) and not os.path.isdir(directory):
        return [f"{directory} is {_what(directory)}, not a checkpoint folder: choose another path"]
    journal = _journal(directory)
    if os.path.lexists(journal) and _what(journal) != "a regular file":
        return [
            f"{journal}, where saves into {name} record what they create, is "
            f"{_what(journal)}: move it away, or save into another folder"
        ]
    if os.path.isdir(directory):
        others = [
            n for n in os.listdir(directory)
            if not any(fnmatch.fnmatch(n, p) for p in _REPLACEABLE)
        ]  # fmt: skip
        if others:
            return [
                f"{directory} holds {sorted(others)[:3]}, which are not a checkpoint's files: a "
                "save replaces the whole folder, so it refuses; save into a new folder"
            ]
    return []


def _missing(directory: str) -> str:
    """Why `directory` is not a folder, from what an interrupted save left beside it."""
    if os.path.lexists(directory):
        return f"it is {_what(directory)}, not a folder"
    tokens = _recorded(directory)
    old, tmp = _previous(directory, tokens), _existing(directory, tokens, "tmp")
    if old:
        return (
            f"a save was killed while replacing it: the previous checkpoint is {old}"
            + (f" and the unfinished new one {tmp[-1]}" if tmp else "")
            + f"; rename {old} to {directory} to load the previous one (the next save "
            "into it does so)"
        )
    if tmp:
        return (
            f"no such folder; a first save into it was killed before it finished ({tmp[-1]} "
            "is what it left)"
        )
    return "no such folder"


def _previous(directory: str, tokens: list[str]) -> str | None:
    """The previous checkpoint that a save into `directory`, killed between its renames, left
    aside: the newest recorded one; else, when a save was recorded but its folder is gone (moved
    by hand), the newest sibling named exactly `.<name>.old-<8 hex digits>` holding a manifest."""
    if found := _existing(directory, tokens, "old"):
        return found[-1]
    if not tokens:
        return None
    parent, prefix = os.path.split(staging_path(directory, "", "old"))
    try:
        names = os.listdir(parent)
    except OSError:
        return None
    found = [
        os.path.join(parent, n) for n in names
        if n.startswith(prefix) and _TOKEN.fullmatch(n[len(prefix) :])
        and os.path.isfile(os.path.join(parent, n, MANIFEST))
    ]  # fmt: skip
    return max(found, key=lambda path: os.stat(path).st_mtime, default=None)


def _existing(directory: str, tokens: list[str], kind: str) -> list[str]:
    paths = (staging_path(directory, token, kind) for token in tokens)
    return [path for path in paths if os.path.lexists(path)]


def _left(directory: str, token: str) -> bool:
    return bool(_existing(directory, [token], "tmp") + _existing(directory, [token], "old"))


def _journal(directory: str) -> str:
    parent, name = os.path.split(os.path.abspath(directory))
    return os.path.join(parent, f".{name}.journal")


def _recorded(directory: str) -> list[str]:
    """The tokens of the saves into `directory` whose folders may be left, oldest first; an
    unreadable journal records nothing (what it named stays on disk, never another's files)."""
    path = _journal(directory)
    try:
        doc = json.loads(read_regular(path, 1 << 16))
    except FileNotFoundError:
        return []
    except (OSError, ValueError, RecursionError, CheckpointError) as exc:
        log.warning("%s is unreadable (%s): what it recorded is not deleted", path, exc)
        return []
    tokens = doc.get("tokens") if isinstance(doc, dict) and doc.get("format") == _JOURNAL else []
    if not isinstance(tokens, list):
        return []
    return [t for t in tokens if isinstance(t, str) and _TOKEN.fullmatch(t)]


def _record(directory: str, tokens: list[str]) -> None:
    """Write the journal of `directory` (flushed to disk), or delete it when it records none."""
    path = _journal(directory)
    if not tokens:
        if os.path.lexists(path):
            os.unlink(path)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    target = os.path.basename(os.path.abspath(directory))
    with os.fdopen(os.open(path, flags, 0o644), "w", encoding="utf-8") as file:
        file.write(json.dumps({"format": _JOURNAL, "target": target, "tokens": tokens}))
        file.flush()
        os.fdatasync(file.fileno())


def _open_regular(path: str) -> Any:
    """`path` opened for reading if it is a regular file (after symlinks), else CheckpointError
    saying what it is; a FIFO swapped in after the check cannot block (O_NONBLOCK)."""
    kind = _what(path)
    if kind == "a regular file":
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        kind = _kind(os.fstat(fd).st_mode)
        if kind == "a regular file":
            return os.fdopen(fd, "rb")
        os.close(fd)
    raise CheckpointError(f"{os.path.basename(path)} is {kind}, not a regular file: not opened")


def _what(path: str) -> str:
    """What `path` is, after symlinks: "a regular file", "a FIFO", ... (FileNotFoundError when
    there is nothing)."""
    try:
        return _kind(os.stat(path).st_mode)
    except FileNotFoundError:
        if os.path.islink(path):
            return "a broken symbolic link"
        raise


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _fsync_dir(path: str) -> None:
    """Make a rename in `path` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
