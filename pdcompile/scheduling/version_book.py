"""Which weight versions a stage replica keeps, by the number of updates they were taken after.
Torch-free: the one bookkeeping the worker (`weight_versions.WeightVersions`, which holds the
tensors) and the simulator (`simulated_weights.SimulatedWeights`, which prices them) share.

A streaming schedule stashes a version per microbatch (`push` at its forward, `pop` after its
backward): the one its rules name (`PipelineSchedule.weight_version`), or the newest weights.
A version is dropped once no microbatch in flight uses it and a newer one exists. A schedule
that `keeps_previous` keeps the weights an update changes (the next step computes on them);
vertical sync keeps the weights after every update (a later microbatch may need them).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcompile.scheduling import PipelineSchedule


class VersionBook:
    """One replica's kept versions. Methods return what the holder must do: the versions to
    copy from the live weights now and the versions to drop (their gradients then move to the
    live weights)."""

    def __init__(
        self,
        rules: PipelineSchedule,
        num_microbatches: int,
        *,
        vertical: bool = False,
        replicas: Sequence[int] = (),
        stage: int = 0,
    ) -> None:
        self.rules, self.num_microbatches = rules, num_microbatches
        self.vertical, self.replicas, self.stage = vertical, tuple(replicas), stage
        self.updates = 0  # optimizer updates so far
        self.users: dict[int, int] = {}  # kept version -> microbatches in flight on it
        self.newest = 0  # the version the latest push picked
        self.stream_base = 0  # updates when the stream (re)started

    @property
    def kept(self) -> list[int]:
        return sorted(self.users)

    def push(self, microbatch: int) -> tuple[int, bool, list[int]]:
        """(version `microbatch` computes on, whether it must be copied now, versions
        dropped). `microbatch` is numbered within the stream."""
        relative = self.rules.weight_version(
            self.replicas, self.stage, microbatch, self.num_microbatches, self.vertical
        )
        version = self.updates if relative is None else max(0, self.stream_base + relative)
        new = version not in self.users
        if new:
            assert version == self.updates, f"version {version} of stage {self.stage} not kept"
            self.users[version] = 0
        self.newest = version
        self.users[version] += 1
        return version, new, self._drop_old()

    def pop(self, version: int) -> list[int]:
        """A microbatch on `version` is done; returns the versions dropped."""
        self.users[version] -= 1
        return self._drop_old()

    def before_update(self) -> tuple[bool, list[int]]:
        """(whether to keep a copy of the weights about to be updated, versions dropped)."""
        if not self.rules.keeps_previous:
            return False, []
        self.newest = self.updates
        dropped = self._drop_old()  # the version this step computed on: its microbatches are done
        new = self.updates not in self.users
        if new:
            self.users[self.updates] = 0
        return new, dropped

    def after_update(self) -> bool:
        """Counts the update; returns whether to keep a copy of the new weights (vertical)."""
        self.updates += 1
        if self.vertical:
            self.users[self.updates] = 0
        return self.vertical

    def begin_stream(self) -> tuple[bool, list[int]]:
        """A stream (re)starts: microbatch numbers count from 0 again. Returns (whether to copy
        the live weights, the versions dropped); a schedule that keeps the previous weights
        keeps them, as the next step computes on them."""
        self.stream_base = self.newest = self.updates
        previous = self.rules.keeps_previous and (self.updates - 1) in self.users
        dropped = [u for u, n in self.users.items() if not n]
        self.users = {u: n for u, n in self.users.items() if n}
        if previous:
            self.newest = self.updates - 1
            dropped = [u for u in dropped if u != self.newest]
            self.users[self.newest] = 0
        if self.vertical:
            self.users[self.updates] = 0
        return self.vertical, dropped

    def restart(self) -> bool:
        """The live weights changed from outside: forget every version, start a stream again;
        returns whether to copy the live weights."""
        self.users.clear()
        return self.begin_stream()[0]

    def _drop_old(self) -> list[int]:
        """Forget the versions no microbatch in flight uses and no later one will."""
        dropped = [u for u, n in self.users.items() if u < self.newest and not n]
        for u in dropped:
            del self.users[u]
        return dropped
