"""Automatic checkpoints and resume: `compile(checkpoint_dir=..., checkpoint_every=N)`.

Every N `train_step`s the job saves a checkpoint into `<checkpoint_dir>/step-<steps, 6 digits>`
(`PipelinedModule.save`: atomic, verified on load) and keeps the newest `KEEP`. On start, every
rank loads the newest valid one: rank 0 lists the folder and every rank takes its list, so all
agree; a checkpoint that does not load (torn, altered, of another model: `CheckpointError`, raised
on every rank together) is skipped with a warning naming it, and the next newer-to-older one is
tried. The module's step count (`PipelinedModule.steps`) then continues from the checkpoint's,
so a job restarted by `torchrun --max-restarts` goes on where it stopped (the data position is
the caller's: skip to batch `steps`). docs/checkpoints.md, "Automatic checkpoints and resume".
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from pdcompile.core.errors import CheckpointError
from pdcompile.runtime import manifest

__all__ = ["KEEP", "AutoCheckpoint", "checkpoint_name", "listed"]

log = logging.getLogger(__name__)

KEEP = 3  # checkpoints kept: the newest, and two older ones should it be damaged
_NAME = re.compile(r"step-(\d{6,})")
_LEFT = re.compile(r"\.(step-(\d{6,}))\.(journal|lease)")  # a save's record and lease


def checkpoint_name(steps: int) -> str:
    """The folder of the checkpoint taken after `steps` train steps: `step-000120`."""
    return f"step-{steps:06d}"


def listed(directory: str) -> list[tuple[int, str]]:
    """`(steps, path)` of the checkpoint folders in `directory`, newest first (not verified:
    a save's staging folders, `.step-...tmp-...`, and other names are not listed)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _NAME.fullmatch(name)
        if match and os.path.isdir(os.path.join(directory, name)):
            found.append((int(match.group(1)), os.path.join(directory, name)))
    return sorted(found, reverse=True)


@dataclass
class AutoCheckpoint:
    """Where and how often a job checkpoints itself, and how it resumes (`skipped`: the
    checkpoints `resume` found damaged, which pruning leaves alone and does not count).
    `compile` builds it from its `TrainConfig`, which checked `directory` and `every`."""

    directory: str
    every: int
    keep: int = KEEP
    skipped: set[str] = field(default_factory=set)
    timeout_s: float = 300.0  # how long ranks wait for rank 0's listing (compile's `timeout`)

    def due(self, steps: int) -> bool:
        """Whether to checkpoint after `steps` train steps."""
        return steps > 0 and steps % self.every == 0

    def save(self, save: Callable[[str], None], steps: int, rank: int) -> str:
        """Save through `save(path)` (every rank) into `step-<steps>`; rank 0 then removes all
        but the newest `keep` that were not skipped. Returns the path."""
        path = os.path.join(self.directory, checkpoint_name(steps))
        save(path)
        if rank == 0:
            self._prune()
        return path

    def _prune(self) -> None:
        """Delete all but the newest `keep` checkpoints not skipped, each with what killed saves
        into it left (journal, lease, staging folders), and such leftovers of older names whose
        folder is gone; never what a live save holds (`manifest.remove`)."""
        kept = [(s, p) for s, p in listed(self.directory) if p not in self.skipped]
        for _, old in kept[self.keep :]:
            manifest.remove(old)
        if len(kept) < self.keep:
            return
        oldest = kept[self.keep - 1][0]
        for name in os.listdir(self.directory):
            match = _LEFT.fullmatch(name)
            path = os.path.join(self.directory, match.group(1)) if match else ""
            if match and int(match.group(2)) < oldest and not os.path.lexists(path):
                manifest.remove(path)

    def resume(self, load: Callable[[str], None]) -> str | None:
        """Load the newest checkpoint that loads, through `load(path)` (every rank, together);
        returns its path, or None when there is none (a fresh start)."""
        for _, path in self._agreed():
            try:
                load(path)
            except CheckpointError as exc:
                log.warning("skipping checkpoint %s, which does not load: %s", path, exc)
                self.skipped.add(path)
                continue
            log.info("resumed from checkpoint %s", path)
            return path
        return None

    def _agreed(self) -> list[tuple[int, str]]:
        """Rank 0's listing, on every rank (a rank listing the folder a moment later could see
        another newest checkpoint)."""
        mine = listed(self.directory)
        if not (dist.is_available() and dist.is_initialized()):
            return mine
        from pdcompile.runtime.bounded import collective

        rank, shared = dist.get_rank(), [mine if dist.get_rank() == 0 else None]
        what = "receiving the checkpoint listing from rank 0" if rank else "sharing the listing"
        collective(rank, what, lambda: dist.broadcast_object_list(shared, src=0), self.timeout_s,
                   "the checkpoint listing", culprit="failed before resuming")  # fmt: skip
        return shared[0]
