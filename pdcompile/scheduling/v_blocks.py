"""V orders built from a repeating building block: what `v-half` and `v-min` share. Torch-free.

Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS'24) build a schedule from
the passes of one microbatch, its building block, repeated once per microbatch. Here 2p stages
sit in a V on p ranks (rank r runs stage r down the V and stage 2p - 1 - r back up,
`chunks.VPlacement`) and backwards are split into I and W. Time is counted in slots of one
pass (F = I = W):

1. **The block** (`Block`, the kind's own): the slot of every stage's F and I of microbatch 0.
   The forwards run down the V and back up, the I's from the top back down; where the passes
   of consecutive stages sit sets how long each rank holds a microbatch's activations (its
   lifespan, from the F to the W of each of its stages).
2. **Repetition**: microbatch k's block is the first shifted by 6k slots (a rank runs six
   passes per microbatch: F, I, W of its two stages). The kind's block takes a `turn`, extra
   slots between the last forward and the first I; the smallest that puts no two of a rank's
   four passes in the same slot modulo 6 is used, leaving two free slots of every six per
   rank: the paper's collision-free repetition.
3. **W's** fill the free slots, each rank's oldest I first. The peak of this timeline, in
   microbatch-chunks (one microbatch's activations of one stage of the V, held from its F to
   its W), is the kind's cap, reached in the steady state: there a rank holds about its two
   lifespans over 6 chunks.
4. **Squeezing and reordering** (the warm-up and the cool-down): in slot order, every pass
   moves to the earliest free slot after its inputs where the rank holds at most the cap
   (a forward moved earlier holds its chunk longer; an I holds nothing new; a W frees
   sooner). The W's left after a rank's last forward are taken out first and put back last,
   in the free slots after their I's, oldest first: the cool-down's I's, its critical path,
   go first.

Each rank's order is its passes in slot order. The slots are one valid timeline of all ranks
(every pass after its inputs), so the orders are valid whatever the stage times: the simulator
and the runtime squeeze them further. No rank holds more than the cap; with fewer microbatches
than the steady state holds, less (`tests/test_schedules_v_memory.py`: the largest rank holds
2 min(M, the paper's count) chunks).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.action_kinds import F, I, W
from pdcompile.scheduling.base import PipelineSchedule
from pdcompile.scheduling.chunks import VPlacement, v_position
from pdcompile.scheduling.placement import Item

PERIOD = 6  # slots from one microbatch's block to the next: a rank's F, I, W of two stages
HOLDS = {F: 1, I: 0, W: -1}  # microbatch-chunks a pass adds to what its rank holds


class Block(NamedTuple):
    """One microbatch's passes through a V of 2p stages: per stage, the slot of its F and
    of its I (its W fills a free slot later)."""

    forward: tuple[int, ...]
    backward: tuple[int, ...]


BlockOf = Callable[[int, int], Block]  # (p, turn) -> the kind's block


def repeatable(block_of: BlockOf, p: int) -> Block:
    """`block_of(p, turn)` with the smallest turn whose repetition every `PERIOD` slots puts
    a rank's four passes in four different slots."""
    for turn in range(PERIOD):
        block = block_of(p, turn)
        slots = [
            {block.forward[s] % PERIOD for s in (r, 2 * p - 1 - r)}
            | {block.backward[s] % PERIOD for s in (r, 2 * p - 1 - r)}
            for r in range(p)
        ]
        if all(len(mine) == 4 for mine in slots):
            return block
    raise ScheduleError(f"the block of a V of {2 * p} stages collides with itself at every turn")


def _inputs(item: Item, p: int) -> list[Item]:
    """The passes `item` waits for: the stage's pass that feeds it and, so that each stage
    runs its microbatches in order, its own kind's previous microbatch."""
    kind, stage, k = item
    if kind == F:
        feeds = [(F, stage - 1, k)] if stage else []
    elif kind == I:
        feeds = [(I, stage + 1, k) if stage < 2 * p - 1 else (F, stage, k)]
    else:
        feeds = [(I, stage, k)]
    return feeds + ([(kind, stage, k - 1)] if k else [])


class _Timeline:
    """Every pass of a V's M microbatches in a slot of its rank (docs in the module)."""

    def __init__(self, block: Block, p: int, num_microbatches: int) -> None:
        self.p = p
        self.slot: dict[Item, int] = {}
        self.taken: list[dict[int, Item]] = [{} for _ in range(p)]
        for k in range(num_microbatches):
            for s in range(2 * p):
                self._put((F, s, k), block.forward[s] + PERIOD * k)
                self._put((I, s, k), block.backward[s] + PERIOD * k)

    def _put(self, item: Item, slot: int) -> None:
        assert slot not in self.taken[v_position(item[1], self.p)], (item, slot)  # collision-free
        self.slot[item] = slot
        self.taken[v_position(item[1], self.p)][slot] = item

    def _take(self, item: Item) -> None:
        del self.taken[v_position(item[1], self.p)][self.slot.pop(item)]

    def fill(self, weights: Iterable[Item]) -> None:
        """Put each W in the first free slot of its rank after its I and after the rank's
        W's of older I's (and its stage's W of the previous microbatch)."""
        free = [0] * self.p  # per rank, the first slot the next W may take
        for w in sorted(weights, key=lambda w: self.slot[(I, w[1], w[2])]):
            r, previous = v_position(w[1], self.p), self.slot.get((W, w[1], w[2] - 1), -1)
            slot = max(free[r], self.slot[(I, w[1], w[2])] + 1, previous + 1)
            while slot in self.taken[r]:
                slot += 1
            self._put(w, slot)
            free[r] = slot + 1

    def lift_drain(self) -> list[Item]:
        """Take out the W's after each rank's last forward (to be filled in again last)."""
        last = [max(s for s, it in mine.items() if it[0] == F) for mine in self.taken]
        drain = [
            it for it, s in self.slot.items() if it[0] == W and s > last[v_position(it[1], self.p)]
        ]
        for w in drain:
            self._take(w)
        return drain

    def levels(self, rank: int, horizon: int) -> list[int]:
        """Microbatch-chunks `rank` holds after each slot up to `horizon`."""
        held, level = [0] * horizon, 0
        for slot in range(horizon):
            item = self.taken[rank].get(slot)
            level += HOLDS[item[0]] if item else 0
            held[slot] = level
        return held

    def peak(self) -> int:
        horizon = max(self.slot.values()) + 1
        return max(max(self.levels(r, horizon)) for r in range(self.p))

    def squeeze(self, cap: int) -> None:
        """Move every pass, in slot order, to the earliest free slot after its inputs where
        its rank holds at most `cap`."""
        horizon = max(self.slot.values()) + 1
        held = [self.levels(r, horizon) for r in range(self.p)]
        for slot, item in sorted((s, it) for it, s in self.slot.items()):
            r, kind = v_position(item[1], self.p), item[0]
            start = max((self.slot[x] + 1 for x in _inputs(item, self.p)), default=0)
            for earlier in range(start, slot):
                if earlier in self.taken[r]:
                    continue
                if kind == F and max(held[r][earlier:slot]) >= cap:
                    continue
                self._take(item)
                self._put(item, earlier)
                for s in range(earlier, slot):
                    held[r][s] += HOLDS[kind]
                break

    def orders(self) -> tuple[tuple[Item, ...], ...]:
        return tuple(tuple(self.taken[r][s] for s in sorted(self.taken[r])) for r in range(self.p))


@functools.lru_cache(maxsize=256)
def block_orders(block_of: BlockOf, p: int, num_microbatches: int) -> tuple[tuple[Item, ...], ...]:
    """Every rank's order (by position in the V) of `block_of`'s block repeated for
    `num_microbatches` microbatches on a V of 2p stages, squeezed under its cap."""
    timeline = _Timeline(repeatable(block_of, p), p, num_microbatches)
    timeline.fill((W, s, k) for k in range(num_microbatches) for s in range(2 * p))
    drain = timeline.lift_drain()
    timeline.squeeze(block_cap(block_of, p))
    timeline.fill(drain)
    return timeline.orders()


@functools.lru_cache(maxsize=64)
def block_cap(block_of: BlockOf, p: int) -> int:
    """Microbatch-chunks a rank holds at most in the steady state of `block_of`'s repeated
    block (its W's filling the free slots): the peak of enough microbatches to reach it."""
    timeline = _Timeline(repeatable(block_of, p), p, 2 * p + 2)
    timeline.fill([(W, s, k) for k in range(2 * p + 2) for s in range(2 * p)])
    return timeline.peak()


class BlockV(VPlacement, PipelineSchedule):
    """A V kind whose orders repeat its `block` (any M >= 1; docs in the module)."""

    items_per_microbatch = 3

    @staticmethod
    @abc.abstractmethod
    def block(p: int, turn: int) -> Block:
        """The kind's building block on a V of 2p stages, `turn` extra slots between the last
        forward and the first I."""

    def check(
        self, replicas: Sequence[int], num_microbatches: int, ties: Sequence[Sequence[int]] = ()
    ) -> None:
        PipelineSchedule.check(self, replicas, num_microbatches)
        if len(replicas) % 2:
            raise ScheduleError(
                f"{self.name} runs 2p stages on p ranks in a V; got {len(replicas)} stages"
            )

    def v_rank_order(self, p: int, num_microbatches: int, position: int) -> list[Item]:
        return list(block_orders(self.block, p, num_microbatches)[position])
