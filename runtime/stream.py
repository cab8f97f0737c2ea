"""The streaming schedules' endless stream, one rank at a time, unfolded as it is walked.

Under a streaming schedule (`pipedream`, `2bw`) the ranks walk the schedule of a pipeline that never
drains. A `RankStream` computes a rank's actions item by item (`schedules.builder.RankOrder`: one
forward or backward with its messages, stashing and update) when they are first needed, and forgets
them once walked (`release`), so its memory stays that of a few items however many steps run between
flushes. Positions are indices into the whole stream.

`drain` gives the rest of the finite schedule of the minibatches given so far, which `flush()`
runs: that schedule is the endless one without the forwards of later minibatches, and each
rank stands at or before its first such forward, so from the item it stands in, the finite
schedule's items are the endless stream's with those forwards left out.
"""

from __future__ import annotations

import sys
from collections import deque

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling import Action
from pdcompile.scheduling.builder import RankOrder

ENDLESS = sys.maxsize  # microbatches of a stream: more than any run gives


class RankStream:
    """One rank's actions in the endless stream of `order`."""

    def __init__(self, order: RankOrder) -> None:
        self.order = order
        self._items = order.items(ENDLESS)
        self._base = 0  # stream index of _actions[0]
        self._actions: list[Action] = []
        self._starts: deque[tuple[int, int]] = deque()  # (stream index, item) of kept items

    def __getitem__(self, index: int | slice) -> Action | list[Action]:
        """An action, or those of a slice `[start:stop]` (both given: the stream is endless)."""
        if isinstance(index, slice):
            if index.stop is None or index.step is not None:
                raise ScheduleError("slice an endless stream with a start and a stop only")
            start, stop = index.start or 0, index.stop
            if stop <= start:
                return []
            self._unfold(stop - 1)
            return self._actions[self._at(start) : self._at(stop)]
        self._unfold(index)
        return self._actions[self._at(index)]

    def release(self, before: int) -> None:
        """Forget the items that end at or before index `before` (walked by every rank that
        looks at them: this rank, and the peers only within a call)."""
        self._unfold(before)
        while len(self._starts) > 1 and self._starts[1][0] <= before:
            self._starts.popleft()
        start = self._starts[0][0]
        del self._actions[: start - self._base]
        self._base = start

    def drain(self, position: int, total: int) -> tuple[Action, ...]:
        """The actions from `position` to the end of the finite schedule of `total`
        microbatches (`flush`; the rank stands at or before its first forward of a later one)."""
        self._unfold(position)
        start, item = next((s, i) for s, i in reversed(self._starts) if s <= position)
        rest = [a for _, actions in self.order.items(total, item) for a in actions]
        return tuple(rest[position - start :])

    @property
    def kept(self) -> int:
        """How many actions are held (bounded while the stream is walked and released)."""
        return len(self._actions)

    def _at(self, index: int) -> int:
        if index < self._base:
            raise ScheduleError(f"stream index {index} was released (kept from {self._base})")
        return index - self._base

    def _unfold(self, index: int) -> None:
        while self._base + len(self._actions) <= index:
            item, actions = next(self._items)
            self._starts.append((self._base + len(self._actions), item))
            self._actions.extend(actions)
