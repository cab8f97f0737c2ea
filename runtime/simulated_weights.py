"""One rank's weights as `StageWorker` keeps them, for the simulator: weight versions, where
gradients are held, and what each action's work on them costs. Torch-free.

The rules are the worker's (runtime/worker.py). Under the streaming schedules a forward runs on
a stashed weight version: `push` copies the live weights when its version is not kept yet
(`pipedream`: the updates made so far; `2bw`: `versions.two_bw_version`), and a version is
dropped once no microbatch in flight uses it and a newer one exists. Backwards accumulate into
the gradients of the weights they ran on (autograd keeps the first ones as they are); those of
a copy move to the live weights when it is dropped or at the next `step`, which also updates
the weights and drops every gradient. `2bw`'s step first keeps a copy of the weights it
updates: the next step computes on them.
"""

from __future__ import annotations

from pdcompile.runtime.action_costs import StageCosts
from pdcompile.runtime.schedules import STREAMING
from pdcompile.runtime.versions import two_bw_version


class SimulatedWeights:
    """One rank's weights under schedule `kind` (`num_microbatches` per step); each action
    method returns the seconds its work on the weights takes. `copies` is the bytes of the
    weight copies held."""

    def __init__(
        self, kind: str, num_microbatches: int, costs: StageCosts, copy_bytes: int
    ) -> None:
        self.kind, self.num_microbatches = kind, num_microbatches
        self.streaming = kind in STREAMING
        self.costs, self.copy_bytes = costs, copy_bytes
        self.updates = 0
        self.newest = 0
        self.users: dict[int, int] = {}  # kept version -> microbatches in flight on it
        self.version_of: dict[int, int] = {}  # microbatch in flight -> its version
        self.holding: set[int] = set()  # versions whose copies hold gradients
        self.live_holds = False  # whether the live weights hold gradients
        self.copies = 0

    def forward(self) -> float:
        """A forward on a weight copy swaps its tensors in."""
        return self.costs.swap_s if self.streaming else 0.0

    def backward(self, microbatch: int) -> float:
        if not self.streaming:
            held, self.live_holds = self.live_holds, True
        else:
            version = self.version_of[microbatch]
            held = version in self.holding
            self.holding.add(version)
        return self.costs.accumulate_s if held else 0.0

    def push(self, microbatch: int) -> float:
        version = self.updates
        if self.kind == "2bw":
            version = two_bw_version(self.num_microbatches, microbatch)
        seconds = 0.0 if version in self.users else self._keep(version)
        self.newest = version
        self.users[version] += 1
        self.version_of[microbatch] = version
        return seconds + self._drop_old()

    def pop(self, microbatch: int) -> float:
        self.users[self.version_of.pop(microbatch)] -= 1
        return self._drop_old()

    def step(self) -> float:
        seconds = sum(self._collect(version) for version in sorted(self.holding))
        if self.kind == "2bw":  # the next step computes on the weights before this update
            self.newest = self.updates
            seconds += self._drop_old()
            if self.updates not in self.users:
                seconds += self._keep(self.updates)
        self.updates += 1
        self.live_holds = False  # the optimizer's zero_grad drops them
        return seconds + self.costs.step_s

    def _keep(self, version: int) -> float:
        self.users[version] = 0
        self.copies += self.copy_bytes
        return self.costs.copy_s

    def _drop_old(self) -> float:
        seconds = 0.0
        for version in [v for v, n in self.users.items() if v < self.newest and not n]:
            seconds += self._collect(version)
            del self.users[version]
            self.copies -= self.copy_bytes
        return seconds

    def _collect(self, version: int) -> float:
        """Move a copy's gradients to the live weights (added to any held there)."""
        if version not in self.holding:
            return 0.0
        self.holding.discard(version)
        held, self.live_holds = self.live_holds, True
        return self.costs.accumulate_s if held else self.costs.collect_s
