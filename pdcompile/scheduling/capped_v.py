"""V orders under a cap on a rank's activations: what `v-half` and `v-min` share. Torch-free.

2p stages sit in a V on p ranks (rank r runs stage r down the V and stage 2p - 1 - r back up,
`chunks.VPlacement`); backwards are split into I and W. Activations are counted in
microbatch-chunks: one microbatch's activations of one stage of the V, half of what a rank
holds for a microbatch that has passed both its stages (a 1F1B stage of the same model, cut
into p stages, holds two chunks per microbatch). A chunk is held from its F to its W.

The orders come from running all ranks together in rounds of unit time (F = I = W), each rank
running one item a round whose inputs were computed in an earlier round:

- a rank admits a new microbatch (its forward down) only while the chunks it holds, plus one
  for each microbatch it has admitted whose forward up has not run yet, plus the two of the
  new one stay within `cap`: the forward up of an admitted microbatch always has room, so the
  orders never deadlock and a rank never holds more than `cap` chunks;
- among the items it can run, an I first (the oldest microbatch; up before down), then a
  forward (up before down), then the oldest W: W's fill the rounds with nothing else to run,
  and run as soon as a rank at its cap must free room to admit the next microbatch.

This is the paper's steady state (Qi et al., "Pipeline Parallelism with Controllable Memory",
NeurIPS'24: a building block whose lifespan bounds the memory, repeated once per microbatch)
found by a list scheduler instead of written block by block; each rank's order is the sequence
of items it ran, so the orders are valid whatever the stage times (they only run slower).
"""

from __future__ import annotations

import abc
import functools
from collections import deque
from collections.abc import Sequence

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.action_kinds import F, I, W
from pdcompile.scheduling.base import PipelineSchedule
from pdcompile.scheduling.chunks import VPlacement
from pdcompile.scheduling.placement import Item


class _Rank:
    """One rank's state: the next F and I of each of its stages, the W's due, the chunks it
    holds (F run, W not) and reserves (one per admitted microbatch not yet forwarded up)."""

    def __init__(self, down: int, up: int) -> None:
        self.down, self.up = down, up
        self.forwards = {down: 0, up: 0}
        self.inputs = {down: 0, up: 0}
        self.due: deque[tuple[int, int]] = deque()
        self.held = 0
        self.order: list[Item] = []

    @property
    def reserved(self) -> int:
        """Chunks held or promised to a forward up already admitted."""
        return self.held + self.forwards[self.down] - self.forwards[self.up]


class _Rounds:
    """All ranks of a V run in rounds of unit time (docs in the module)."""

    def __init__(self, p: int, num_microbatches: int, cap: int) -> None:
        self.p, self.m, self.cap = p, num_microbatches, cap
        self.ranks = [_Rank(r, 2 * p - 1 - r) for r in range(p)]
        self.done: dict[tuple[str, int, int], int] = {}  # item -> its round

    def _ready(self, item: tuple[str, int, int], now: int) -> bool:
        return self.done.get(item, now) < now

    def _choices(self, rank: _Rank, now: int) -> list[Item]:
        """What `rank` may run in round `now`, best first."""
        last = 2 * self.p - 1
        inputs = []
        for stage in (rank.up, rank.down):
            k = rank.inputs[stage]
            below = (F, stage, k) if stage == last else (I, stage + 1, k)
            if k < rank.forwards[stage] and self._ready((F, stage, k), now):
                if self._ready(below, now):
                    inputs.append((I, stage, k))
        inputs.sort(key=lambda item: (item[2], -item[1]))
        forwards = []
        for stage in (rank.up, rank.down):
            k = rank.forwards[stage]
            if k >= self.m or (stage and not self._ready((F, stage - 1, k), now)):
                continue
            if stage == rank.down and rank.reserved + 2 > self.cap:
                continue
            forwards.append((F, stage, k))
        weights = [(W, *rank.due[0])] if rank.due else []
        return inputs + forwards + weights

    def _run(self, rank: _Rank, item: Item, now: int) -> None:
        kind, stage, k = item
        if kind == F:
            rank.forwards[stage] += 1
            rank.held += 1
        elif kind == I:
            rank.inputs[stage] += 1
            rank.due.append((stage, k))
        else:
            rank.due.popleft()
            rank.held -= 1
        rank.order.append(item)
        self.done[item] = now

    def orders(self) -> list[list[Item]]:
        """Every rank's order, by position in the V."""
        total, now = 3 * 2 * self.m * self.p, 0
        while len(self.done) < total:
            moved = False
            for rank in self.ranks:
                choices = self._choices(rank, now)
                if choices:
                    self._run(rank, choices[0], now)
                    moved = True
            if not moved:
                raise ScheduleError(f"a V capped at {self.cap} chunks per rank is stuck")
            now += 1
        return [rank.order for rank in self.ranks]


@functools.lru_cache(maxsize=256)
def capped_v_orders(p: int, num_microbatches: int, cap: int) -> tuple[tuple[Item, ...], ...]:
    """Every rank's order (by position in the V) of a V of 2p stages, `num_microbatches`
    microbatches, each rank holding at most `cap` microbatch-chunks (at least 2)."""
    if cap < 2:
        raise ScheduleError(f"a V needs room for two chunks per rank, got a cap of {cap}")
    return tuple(tuple(order) for order in _Rounds(p, num_microbatches, cap).orders())


class CappedV(VPlacement, PipelineSchedule):
    """A V kind whose orders are `capped_v_orders` under its `cap` (any M >= 1)."""

    items_per_microbatch = 3

    @abc.abstractmethod
    def cap(self, p: int) -> int:
        """Microbatch-chunks a rank of a V on p ranks holds at most."""

    def check(
        self, replicas: Sequence[int], num_microbatches: int, ties: Sequence[Sequence[int]] = ()
    ) -> None:
        PipelineSchedule.check(self, replicas, num_microbatches)
        if len(replicas) % 2:
            raise ScheduleError(
                f"{self.name} runs 2p stages on p ranks in a V; got {len(replicas)} stages"
            )

    def v_rank_order(self, p: int, num_microbatches: int, position: int) -> list[Item]:
        return list(capped_v_orders(p, num_microbatches, self.cap(p))[position])
