"""The weight versions a streaming schedule's microbatches compute on (PipeDream's stashing).

A version is a detached copy of the live weights taken after some number of updates, shared by
every microbatch that computes on it: its forward runs on the copy (`runtime/weight_slots.py`)
and its backward runs through the same copy, where autograd accumulates the gradients. Which
versions exist and when they go is `pdcompile/scheduling/version_book.py`'s bookkeeping (the
simulator
runs the same); a dropped version's gradients move to the live weights, as every copy's do
before an update (`collect`).

A new version copies nothing: its tensors are new leaves on the live weights' storage. Only an
update changes the live weights, so just before one (`before_update`), if a version sharing
their storage is still in use, the live parameters move to other storage holding the same values
(`p.data = ...`: one copy, into the storage of a version dropped earlier when there is one), and
the version keeps the old: the one copy per update the old code made at `push`, now into reused
storage (a version still kept while it is the newest counts as in use: a later microbatch may
compute on it).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from pdcompile.scheduling import PipelineSchedule
from pdcompile.scheduling.version_book import VersionBook

Weights = dict[str, torch.Tensor]


def copy_weights(params: dict[str, nn.Parameter]) -> Weights:
    """Detached copies of weights, as leaves a forward can run on and a backward fill."""
    return {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}


class WeightVersions:
    """One stage replica's weight versions, by the number of updates they were taken after.

    Args:
        params: the live parameters by name (updated in place by the optimizer).
        rules: the schedule (only streaming ones keep versions).
        num_microbatches: microbatches per step.
        vertical: vertical sync (a schedule that offers it), for `stage` of a plan with
            `replicas`.
    """

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        rules: PipelineSchedule,
        num_microbatches: int,
        *,
        vertical: bool = False,
        replicas: list[int] | None = None,
        stage: int = 0,
    ) -> None:
        self.params = params
        self.book = VersionBook(
            rules, num_microbatches, vertical=vertical, replicas=replicas or [], stage=stage
        )
        self.copies: dict[int, Weights] = {}  # updates -> weights
        self.shared: set[int] = set()  # versions on the live weights' storage
        self.spare: list[Weights] = []  # dropped versions' tensors, storage for the next copy

    @property
    def updates(self) -> int:
        """Optimizer updates so far."""
        return self.book.updates

    @updates.setter
    def updates(self, value: int) -> None:
        self.book.updates = value

    def push(self, microbatch: int) -> int:
        """The version `microbatch` (numbered within the stream) computes on, now in use."""
        version, new, dropped = self.book.push(microbatch)
        if new:
            self._share(version)
        self._drop(dropped)
        return version

    def pop(self, version: int) -> None:
        """A microbatch on `version` is done (its backward ran)."""
        self._drop(self.book.pop(version))

    def collect(self, *copies: Weights) -> None:
        """Move the gradients backwards left on weight copies (default: every version kept) to
        the live weights. Every backward since the last update belongs to the next one, so this
        may happen at any time before it."""
        for weights in copies or tuple(self.copies.values()):
            for name, copy in weights.items():
                if copy.grad is not None:
                    live = self.params[name]
                    live.grad = copy.grad if live.grad is None else live.grad + copy.grad
                    copy.grad = None

    def before_update(self) -> None:
        """A schedule that keeps the previous weights: the next step computes on the weights
        as they are now, before the update."""
        new, dropped = self.book.before_update()
        self._drop(dropped)
        if new:
            self._share(self.book.updates)
        self._unshare()

    def after_update(self) -> None:
        if self.book.after_update():
            self._share(self.book.updates)

    def begin_stream(self) -> None:
        """A stream (re)starts: microbatch numbers count from 0 again."""
        fresh, dropped = self.book.begin_stream()
        for u in dropped:
            self.copies.pop(u, None)
            self.shared.discard(u)
        if fresh:
            self._share(self.book.updates)

    def restart(self) -> None:
        """The live weights changed from outside (a checkpoint loaded): start again from them."""
        self.copies.clear()
        self.shared.clear()
        self.spare.clear()
        if self.book.restart():
            self._share(self.book.updates)

    @property
    def previous(self) -> Weights:
        """The weights before the last update, which the next step computes on, for a schedule
        that keeps them ({} before the first update and under the others)."""
        if not self.book.rules.keeps_previous:
            return {}
        return self.copies.get(self.book.updates - 1, {})

    def restore_previous(self, weights: dict[str, torch.Tensor]) -> None:
        """After a checkpoint load, for a schedule that keeps the previous weights: the weights
        before the last update (names missing from `weights` take the live ones)."""
        book = self.book
        if not book.rules.keeps_previous or not book.updates:
            return
        live = copy_weights(self.params)
        book.newest = book.updates - 1
        book.users.setdefault(book.newest, 0)
        self.copies[book.newest] = {
            n: weights[n].detach().clone().requires_grad_(t.requires_grad) if n in weights else t
            for n, t in live.items()
        }

    def _drop(self, versions: list[int]) -> None:
        for u in versions:
            weights = self.copies.pop(u)
            self.collect(weights)
            if u in self.shared:
                self.shared.discard(u)
            elif not self.spare:  # one set is all a copy needs
                self.spare.append(weights)

    def _share(self, version: int) -> None:
        """Keep `version`: new leaves on the live weights' storage (no copy)."""
        self.copies[version] = {
            n: p.data.requires_grad_(p.requires_grad) for n, p in self.params.items()
        }
        self.shared.add(version)

    def _unshare(self) -> None:
        """An update comes: the live weights move to other storage holding their values, where
        a version still in use shares theirs (which it keeps)."""
        if not any(u in self.copies for u in self.shared):
            self.shared.clear()
            return
        spare = self.spare.pop() if self.spare else {}
        with torch.no_grad():
            for name, p in self.params.items():
                into = spare.get(name)
                fresh = torch.empty_like(p) if into is None else into.detach()
                p.data = fresh.copy_(p.detach())
        self.shared.clear()
