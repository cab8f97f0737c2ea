"""The format of a checkpoint's `manifest.json`: what it records, and the checks of a parsed one.

`runtime/manifest.py` reads, verifies and writes the file (docs/checkpoints.md, "On disk").
Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdcompile.core.errors import CheckpointError

__all__ = ["FORMAT", "MANIFEST", "VERSION", "Manifest"]

MANIFEST = "manifest.json"
FORMAT = "pdcompile.checkpoint"
VERSION = 1
_SHA256_HEX = 64


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
