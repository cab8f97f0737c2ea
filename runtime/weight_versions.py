"""The weight versions a streaming schedule's microbatches compute on (PipeDream's stashing).

A version is a detached copy of the live weights taken after some number of updates, shared by
every microbatch that computes on it: its forward runs on the copy (`runtime/weight_slots.py`)
and its backward runs through the same copy, where autograd accumulates the gradients. Which
version a microbatch gets: the newest under `pipedream`, `runtime/versions.py`'s under vertical
sync and `2bw`. A version is dropped when no microbatch in flight uses it and none to come will;
its gradients then move to the live weights, as every copy's do before an update (`collect`).
`2bw` keeps the weights before the last update: the next step computes on them. The simulator
mirrors this bookkeeping in `runtime/simulated_weights.py`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from pdcompile.runtime.versions import two_bw_version, vertical_version

Weights = dict[str, torch.Tensor]


def copy_weights(params: dict[str, nn.Parameter]) -> Weights:
    """Detached copies of weights, as leaves a forward can run on and a backward fill."""
    return {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}


class WeightVersions:
    """One stage replica's weight versions, by the number of updates they were taken after.

    Args:
        params: the live parameters by name (updated in place by the optimizer).
        kind: the schedule, "pipedream" or "2bw" (the others keep no versions).
        num_microbatches: microbatches per step (`2bw`'s versions count steps).
        vertical: `pipedream` with vertical sync, for `stage` of a plan with `replicas`.
    """

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        kind: str,
        num_microbatches: int,
        *,
        vertical: bool = False,
        replicas: list[int] | None = None,
        stage: int = 0,
    ) -> None:
        self.params, self.kind, self.num_microbatches = params, kind, num_microbatches
        self.vertical, self.replicas, self.stage = vertical, replicas or [], stage
        self.updates = 0  # optimizer updates so far
        self.copies: dict[int, Weights] = {}  # updates -> weights
        self.users: dict[int, int] = {}  # updates -> microbatches in flight on that version
        self.newest = 0  # the version the latest push picked
        self.stream_base = 0  # updates when the stream (re)started

    def push(self, microbatch: int) -> int:
        """The version `microbatch` (numbered within the stream) computes on, now in use."""
        u = self.updates
        if self.vertical:
            u = self.stream_base + vertical_version(self.replicas, self.stage, microbatch)
        elif self.kind == "2bw":
            u = two_bw_version(self.num_microbatches, microbatch, self.stream_base)
        if u not in self.copies:
            assert u == self.updates, f"version {u} of stage {self.stage} was not kept"
            self.copies[u] = copy_weights(self.params)
        self.newest = u
        self.users[u] = self.users.get(u, 0) + 1
        self._drop_old()
        return u

    def pop(self, version: int) -> None:
        """A microbatch on `version` is done (its backward ran)."""
        self.users[version] -= 1
        self._drop_old()

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
        """`2bw`: the next step computes on the weights as they are now, before the update."""
        if self.kind == "2bw":
            self.newest = self.updates
            self._drop_old()  # the version this step computed on: its microbatches are done
            if self.updates not in self.copies:
                self.copies[self.updates] = copy_weights(self.params)

    def after_update(self) -> None:
        self.updates += 1
        if self.vertical:
            self.copies[self.updates] = copy_weights(self.params)

    def begin_stream(self) -> None:
        """A stream (re)starts: microbatch numbers count from 0 again. `2bw` keeps the weights
        before the last update: the next step computes on them."""
        self.stream_base = self.newest = self.updates
        previous = self.previous
        self.copies = {u: w for u, w in self.copies.items() if self.users.get(u)}
        if previous:
            self.newest = self.updates - 1
            self.copies[self.newest] = previous
        if self.vertical:
            self.copies[self.updates] = copy_weights(self.params)

    def restart(self) -> None:
        """The live weights changed from outside (a checkpoint loaded): start again from them."""
        self.copies.clear()
        self.users.clear()
        self.begin_stream()

    @property
    def previous(self) -> Weights:
        """`2bw`: the weights before the last update, which the next step computes on ({}
        before the first update and under the other schedules)."""
        return self.copies.get(self.updates - 1, {}) if self.kind == "2bw" else {}

    def restore_previous(self, weights: dict[str, torch.Tensor]) -> None:
        """`2bw` after a checkpoint load: the weights before the last update (names missing
        from `weights` take the live ones)."""
        if self.kind != "2bw" or not self.updates:
            return
        live = copy_weights(self.params)
        self.copies[self.updates - 1] = {
            n: weights[n].detach().clone().requires_grad_(t.requires_grad) if n in weights else t
            for n, t in live.items()
        }
        self.newest = self.updates - 1

    def _drop_old(self) -> None:
        """Forget versions no microbatch in flight uses and no later one will."""
        for u in [u for u in self.copies if u < self.newest and not self.users.get(u)]:
            self.collect(self.copies.pop(u))
            self.users.pop(u, None)
