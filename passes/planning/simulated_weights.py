"""One rank's weights as `StageWorker` keeps them, for the simulator: weight versions, where
gradients are held, and what each action's work on them costs. Torch-free.

Which versions exist is the worker's own bookkeeping (`pdcompile/scheduling/version_book.py`), run
on the
same actions. Under the streaming schedules a forward runs on a stashed weight version: `push`
keeps the live weights as a new version when its version is not kept yet (sharing their storage:
free), and a version is dropped once no microbatch in flight uses it and a newer one exists. A
`step` copies the weights once (`copy_s`) when a version sharing them is still kept (the live
weights move to other storage before the update: `runtime/weight_versions.py`). Backwards
accumulate into the gradients of the weights they ran on (autograd keeps the first ones as they
are); those of a copy move to the live weights when it is dropped or at the next `step`, which
also updates the weights and drops every gradient. A schedule that keeps the previous weights
first keeps the weights its step updates (the next step computes on them), which the same copy
moves apart.

Memory: `copies` is the bytes of the weight versions held (counted from `push`, as the memory
probe counts a version sharing the live weights' storage), `grads` those of the gradients (a set
per holder: the live weights and each copy a backward ran on), which appear with a backward
(`backward`) and go at the update (`step`: the optimizer's `zero_grad` frees them).
"""

from __future__ import annotations

from pdcompile.passes.planning.action_costs import StageCosts
from pdcompile.scheduling import PipelineSchedule
from pdcompile.scheduling.version_book import VersionBook


class SimulatedWeights:
    """One replica's weights under schedule `rules` (`num_microbatches` per step); each action
    method returns the seconds its work on the weights takes. `copies` is the bytes of the
    weight copies held (`copy_bytes` each), `grads` those of the gradients held (`grad_bytes`
    per set)."""

    def __init__(
        self, rules: PipelineSchedule, num_microbatches: int, costs: StageCosts, copy_bytes: int,
        grad_bytes: int = 0,
    ) -> None:  # fmt: skip
        self.book = VersionBook(rules, num_microbatches)
        self.streaming = rules.streaming
        self.costs, self.copy_bytes, self.grad_bytes = costs, copy_bytes, grad_bytes
        self.version_of: dict[int, int] = {}  # microbatch in flight -> its version
        self.holding: set[int] = set()  # versions whose copies hold gradients
        self.live_holds = False  # whether the live weights hold gradients
        self.copies = 0
        self.shared: set[int] = set()  # versions on the live weights' storage

    @property
    def grads(self) -> int:
        """Bytes of the gradients held: a set on the live weights and on each copy holding
        some."""
        return self.grad_bytes * (self.live_holds + len(self.holding))

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
        version, new, dropped = self.book.push(microbatch)
        self.version_of[microbatch] = version
        if new:
            self._keep(version)
        return self._drop(dropped)

    def pop(self, microbatch: int) -> float:
        return self._drop(self.book.pop(self.version_of.pop(microbatch)))

    def step(self) -> float:
        seconds = sum(self._collect(version) for version in sorted(self.holding))
        new, dropped = self.book.before_update()
        seconds += self._drop(dropped)
        if new:
            self._keep(self.book.updates)
        if any(v in self.book.users for v in self.shared):  # the live weights move apart
            seconds += self.costs.copy_s
        self.shared.clear()
        self.book.after_update()
        self.live_holds = False  # the optimizer's zero_grad drops them
        return seconds + self.costs.step_s

    def _keep(self, version: int) -> None:
        self.copies += self.copy_bytes
        self.shared.add(version)

    def _drop(self, versions: list[int]) -> float:
        seconds = 0.0
        for version in versions:
            seconds += self._collect(version)
            self.copies -= self.copy_bytes
            self.shared.discard(version)
        return seconds

    def _collect(self, version: int) -> float:
        """Move a copy's gradients to the live weights (added to any held there)."""
        if version not in self.holding:
            return 0.0
        self.holding.discard(version)
        held, self.live_holds = self.live_holds, True
        return self.costs.accumulate_s if held else self.costs.collect_s
