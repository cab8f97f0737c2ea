"""A checkpoint's `manifest.json` (checksums of every file) and its atomic replacement on disk.

A save writes into a staging folder beside the target, `.<name>.tmp-<token>`; rank 0 then writes
`manifest.json` (the size and SHA-256 of every other file, the step, what the checkpoint holds)
and `commit` puts the folder in place: the previous checkpoint is renamed to `.<name>.old-<token>`,
the new one to `<name>`, and the old one is deleted. A process killed at any point leaves the
previous checkpoint or the new one, whole (docs/checkpoints.md, "Atomic saves"). Readers check the
manifest and the checksums before opening any file: torch.distributed.checkpoint's `.metadata` is
a pickle. Torch-free.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdcompile.errors import CheckpointError

__all__ = ["MANIFEST", "Manifest", "commit", "prepare", "read", "staging_path", "verify"]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "pdcompile.checkpoint"
VERSION = 1
_CHUNK = 1 << 20
_SHA256_HEX = 64
# what a folder may hold for a save to replace it: a checkpoint's own files
_REPLACEABLE = (MANIFEST, ".metadata", "*.distcp")


@dataclass(frozen=True)
class Manifest:
    """What `manifest.json` records.

    `files`: name -> (bytes, SHA-256 hex) of every file of the checkpoint but the manifest.
    `model`: the original model's names saved; `optimizer`: whether optimizer state was saved;
    `extra`: the keys of the ranks' `extra`; `step`: the caller's step count, or None.
    """

    files: Mapping[str, tuple[int, str]]
    world_size: int
    model: tuple[str, ...] = ()
    optimizer: bool = False
    extra: tuple[str, ...] = ()
    step: int | None = None

    def to_json(self) -> str:
        holds = {"model": list(self.model), "optimizer": self.optimizer, "extra": list(self.extra)}
        files = {n: {"bytes": b, "sha256": s} for n, (b, s) in sorted(self.files.items())}
        return json.dumps(
            {"format": FORMAT, "version": VERSION, "step": self.step,
             "world_size": self.world_size, "holds": holds, "files": files},
            indent=1,
        )  # fmt: skip

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        """Parse and check a manifest.

        Raises:
            CheckpointError: `source` is not valid JSON or not a manifest of this format,
                naming the field at fault.
        """
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            raise CheckpointError(
                f"{source} is not valid JSON ({exc}): the save did not finish or the file was "
                "altered; load an earlier checkpoint"
            ) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CheckpointError(f"{source} is not a pdcompile checkpoint manifest")
        if doc.get("version") != VERSION:
            raise CheckpointError(
                f"{source}: manifest version {doc.get('version')!r}; this pdcompile reads "
                f"version {VERSION}: upgrade pdcompile"
            )
        problems = _problems(doc)
        if problems:
            raise CheckpointError(
                f"{source} is malformed: " + "; ".join(problems[:3]) + ": the file was altered; "
                "load an earlier checkpoint"
            )
        holds = doc["holds"]
        return cls(
            files={n: (e["bytes"], e["sha256"].lower()) for n, e in doc["files"].items()},
            world_size=doc["world_size"],
            model=tuple(holds["model"]),
            optimizer=holds["optimizer"],
            extra=tuple(holds["extra"]),
            step=doc["step"],
        )


def read(directory: str) -> Manifest:
    """The manifest of the checkpoint in `directory` (no other file is opened).

    Raises:
        CheckpointError: no such folder (saying what an interrupted save left beside it), no
            manifest (a torch.distributed.checkpoint folder, or not a checkpoint), or a
            malformed one.
    """
    where = f"checkpoint {directory}"
    if not os.path.isdir(directory):
        raise CheckpointError(f"{where}: not a checkpoint: {_missing(directory)}")
    try:
        with open(os.path.join(directory, MANIFEST), "rb") as file:
            text = file.read().decode("utf-8")
    except FileNotFoundError:
        if os.path.exists(os.path.join(directory, ".metadata")):
            raise CheckpointError(
                f"{where}: a torch.distributed.checkpoint directory without pdcompile's "
                f"{MANIFEST}: not opened, since its metadata is a pickle and only checkpoints "
                "whose checksums verify are read; if you trust it, read it with "
                "torch.distributed.checkpoint.load"
            ) from None
        raise CheckpointError(
            f"{where}: not a checkpoint: no {MANIFEST}; the path is wrong or a save did not finish"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{where}: cannot read {MANIFEST}: {exc}") from None
    return Manifest.from_json(text, f"{where}: {MANIFEST}")


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
            found = os.path.getsize(path)
            if found != size:
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
    files = {}
    for name in sorted(os.listdir(directory)):
        if name != MANIFEST:
            path = os.path.join(directory, name)
            files[name] = (os.path.getsize(path), sha256(path))
    return Manifest(files=files, world_size=world_size, **holds)


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def staging_path(directory: str, token: str, kind: str = "tmp") -> str:
    """`<parent>/.<name>.<kind>-<token>`: where a save writes (`tmp`) or the old one waits."""
    parent, name = os.path.split(os.path.abspath(directory))
    return os.path.join(parent, f".{name}.{kind}-{token}")


def prepare(directory: str) -> list[str]:
    """Before a save into `directory`: refuse to replace a folder that is not a checkpoint,
    restore a previous checkpoint that a save killed between its two renames left aside, and
    delete what interrupted saves left. Returns the problems (empty: go ahead)."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        return [f"{directory} is a file, not a checkpoint folder: choose another path"]
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
    old = _leftovers(directory, "old")
    if old and not os.path.lexists(directory):
        log.warning("restoring %s from %s (a save was cut short)", directory, old[-1])
        os.rename(old[-1], directory)
    for leftover in _leftovers(directory, "tmp") + _leftovers(directory, "old"):
        shutil.rmtree(leftover, ignore_errors=True)
    return []


def commit(staging: str, directory: str, token: str) -> None:
    """Put the complete checkpoint `staging` in place of `directory` (see the module doc)."""
    old = staging_path(directory, token, "old")
    replaced = os.path.lexists(directory)
    if replaced:
        os.rename(directory, old)
    os.rename(staging, directory)
    _fsync_dir(os.path.dirname(os.path.abspath(directory)))
    if replaced:
        shutil.rmtree(old)


def _missing(directory: str) -> str:
    """Why `directory` does not exist, from what an interrupted save left beside it."""
    old, tmp = _leftovers(directory, "old"), _leftovers(directory, "tmp")
    if old:
        return (
            f"a save was killed while replacing it: the previous checkpoint is {old[-1]}"
            + (f" and the unfinished new one {tmp[-1]}" if tmp else "")
            + f"; rename {old[-1]} to {directory} to load the previous one (the next save "
            "into it does so)"
        )
    if tmp:
        return (
            f"no such folder; a first save into it was killed before it finished ({tmp[-1]} "
            "is what it left)"
        )
    return "no such folder"


def _leftovers(directory: str, kind: str) -> list[str]:
    """What interrupted saves of `directory` left: `.<name>.<kind>-*`, oldest first."""
    # a prefix match, not glob: glob caches a compiled pattern per folder name, ~1.7 KB that
    # every save into a new folder (ckpt/step-N) would add, up to 32,768 patterns
    parent, prefix = os.path.split(staging_path(directory, "", kind))
    try:
        names = os.listdir(parent)
    except OSError:  # no parent folder: nothing left
        names = []
    found = [os.path.join(parent, n) for n in names if n.startswith(prefix)]
    return sorted(found, key=lambda path: os.stat(path).st_mtime if os.path.exists(path) else 0)


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


def _problems(doc: dict[str, Any]) -> list[str]:
    """What is wrong with the fields of a parsed manifest."""
    problems = []
    step, world_size = doc.get("step", -1), doc.get("world_size")
    if step is not None and not _count(step):
        problems.append(f"'step' is {step!r}, not null or an integer >= 0")
    if not (_count(world_size) and world_size >= 1):
        problems.append(f"'world_size' is {world_size!r}, not an integer >= 1")
    holds = doc.get("holds")
    if not (
        isinstance(holds, dict)
        and _strings(holds.get("model"))
        and isinstance(holds.get("optimizer"), bool)
        and _strings(holds.get("extra"))
    ):
        problems.append("'holds' is not {model: [names], optimizer: bool, extra: [keys]}")
    files = doc.get("files")
    if not isinstance(files, dict):
        return [*problems, "'files' is not an object"]
    for name, entry in files.items():
        if not _plain(name):
            problems.append(f"'files' lists {name!r}, not a file name inside the folder")
        elif not (
            isinstance(entry, dict)
            and set(entry) == {"bytes", "sha256"}
            and _count(entry["bytes"])
            and isinstance(entry["sha256"], str)
            and len(entry["sha256"]) == _SHA256_HEX
        ):
            problems.append(f"'files' entry {name!r} is not {{bytes: int, sha256: hex}}")
    return problems


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _plain(name: str) -> bool:
    """A file name directly inside the folder: no separators, not `.`, `..` or the manifest."""
    base = os.path.basename(name)
    return base == name and name not in ("", ".", "..", MANIFEST) and not set(name) & {"\\", "\0"}
