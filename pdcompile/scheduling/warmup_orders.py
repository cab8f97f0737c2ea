"""Orders in which every replica runs its own microbatches with a warm-up: the 1F1B family.
Torch-free.

`WarmupSchedule` gives `rank_orders` from one rule per replica: `warmup` forwards, then a
forward and a backward alternately, then the remaining backwards (`compute_item`, computed
item by item: a stream's order is endless), or a whole order of its own (`replica_order`). A
rank running one stage runs its replica's order; a rank running several runs their orders merged
in an order their messages allow (`merge_orders`). `1f1b`, `gpipe`, `pipedream`, `2bw`, `zb-h1`
and `zb-h2` are such schedules (the last two split the backward and defer the W's).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.action_kinds import ACT, GRAD, B, F, kind
from pdcompile.scheduling.base import PipelineSchedule
from pdcompile.scheduling.placement import ENDLESS, Item, Placement

__all__ = ["WarmupSchedule", "merge_orders"]


class WarmupSchedule(PipelineSchedule):
    """A schedule whose replicas each run their own order: by default PipeDream's warm-up
    w_s = (sum_{t>=s} r_t - 1) // r_s forwards, then F and B alternately, then the last B's
    (1F1B's order). Override `warmup`, `compute_item` or `replica_order`."""

    def warmup(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """Forwards a replica of `stage` runs before its first backward (PipeDream's rule:
        w_s = (sum_{t>=s} r_t - 1) // r_s)."""
        return (sum(replicas[stage:]) - 1) // replicas[stage]

    def compute_item(self, warmup: int, mine: Sequence[int], t: int) -> tuple[str, int]:
        """Item t (of `items_per_microbatch * len(mine)`) of one replica's compute for its
        microbatches `mine`: (kind, microbatch). Default: `warmup` forwards, then a forward
        and a backward alternately, then the remaining backwards. Computed, not listed:
        `mine` may be endless (a stream)."""
        n = len(mine)
        w = min(warmup, n)
        if t < w:
            return F, mine[t]
        t -= w
        pairs = n - w  # backwards with a forward before them
        if t < 2 * pairs:
            return (F, mine[t // 2 + w]) if t % 2 == 0 else (B, mine[t // 2])
        return B, mine[pairs + t - 2 * pairs]

    def replica_order(
        self, replicas: Sequence[int], stage: int, num_microbatches: int, mine: Sequence[int]
    ) -> list[tuple[str, int]]:
        """A synchronous replica's whole compute for its microbatches `mine`, in order
        ((kind, microbatch) items). Default: `compute_item` over `warmup`; a schedule whose
        order needs more of the layout than the warm-up overrides this (streaming ones unfold
        `compute_item` lazily instead)."""
        w = self.warmup(replicas, stage, num_microbatches)
        count = self.items_per_microbatch * len(mine)
        return [self.compute_item(w, mine, t) for t in range(count)]

    def rank_orders(self, placement: Placement) -> Mapping[int, Sequence[Item]]:
        """Each replica's own order; a rank running several stages merges theirs."""
        return ReplicaOrders(self, placement)


class _Unfolded(Sequence):
    """A stream replica's order, item t computed when indexed (`compute_item`)."""

    def __init__(self, rules: WarmupSchedule, placement: Placement, rank: int, stage: int):
        self.rules, self.stage = rules, stage
        self.mine = placement.mine(rank, stage)
        self.warmup = rules.warmup(placement.replicas, stage, placement.num_microbatches)
        self.count = rules.items_per_microbatch * len(self.mine)

    def __len__(self) -> int:
        return min(self.count, ENDLESS)  # an endless stream's: as many as `len` counts

    def __iter__(self) -> Iterator[Item]:
        return (self[t] for t in range(self.count))

    def __getitem__(self, t: Any) -> Any:
        """Item t (0 <= t < `count`: the caller's bound), or the items of a slice."""
        if isinstance(t, slice):
            return [self[i] for i in range(*t.indices(self.count))]
        letter, k = self.rules.compute_item(self.warmup, self.mine, t)
        return letter, self.stage, k


class ReplicaOrders(Mapping):
    """Every rank's order of a `WarmupSchedule`, each computed when first asked for (a rank
    that runs no stage of the placement has an empty one)."""

    def __init__(self, rules: WarmupSchedule, placement: Placement) -> None:
        self.rules, self.placement = rules, placement
        self._merged: dict[int, list[Item]] | None = None

    def __getitem__(self, rank: int) -> Sequence[Item]:
        placement = self.placement
        stages = placement.stages_of(rank)
        if not stages:
            return ()
        if len(stages) == 1:
            return self._replica(rank, stages[0])
        if self._merged is None:  # every rank runs in the rounds: its messages time the others
            orders = {(r, s): [(kind_, k) for kind_, _, k in self._replica(r, s)]
                      for r in placement.world for s in placement.stages_of(r)}  # fmt: skip
            self._merged = merge_orders(placement, orders)
        return self._merged[rank]

    def _replica(self, rank: int, stage: int) -> Sequence[Item]:
        placement, rules = self.placement, self.rules
        if rules.streaming:
            return _Unfolded(rules, placement, rank, stage)
        mine = placement.mine(rank, stage)
        order = rules.replica_order(placement.replicas, stage, placement.num_microbatches, mine)
        return [(letter, stage, k) for letter, k in order]

    def __iter__(self) -> Iterator[int]:
        return iter(self.placement.world)

    def __len__(self) -> int:
        return len(self.placement.world)


def merge_orders(
    placement: Placement, orders: Mapping[tuple[int, int], Sequence[tuple[str, int]]]
) -> dict[int, list[Item]]:
    """Every rank's order from the orders of its stages' replicas (`orders[(rank, stage)]`:
    (kind, microbatch) items), merged in an order their messages allow.

    Every rank is run in rounds of unit time: in each round a rank runs one item whose
    received messages were sent in an earlier round, the backward parts first, then the
    lowest microbatch, then the lowest stage. Each stage keeps its own order.

    Raises:
        ScheduleError: no rank can move (a stage's own order needs a message that comes
            later).
    """
    queues: dict[int, dict[int, deque[tuple[str, int]]]] = {}
    for (rank, stage), order in orders.items():
        queues.setdefault(rank, {})[stage] = deque(order)
    sent: set[tuple] = set()
    merged: dict[int, list[Item]] = {rank: [] for rank in queues}
    while any(q for stage_queues in queues.values() for q in stage_queues.values()):
        ready = {}
        for rank, stage_queues in queues.items():
            heads = [
                (stage, q[0]) for stage, q in stage_queues.items()
                if q and all(m in sent for m in _messages(placement, stage, *q[0], received=True))
            ]  # fmt: skip
            if heads:
                ready[rank] = min(heads, key=lambda h: (kind(h[1][0]).starts, h[1][1], h[0]))
        if not ready:
            raise ScheduleError(
                "the stages sharing a rank cannot be merged: every rank waits for a message "
                "(a stage's own order needs one that comes later)"
            )
        for rank, (stage, (letter, k)) in ready.items():
            queues[rank][stage].popleft()
            merged[rank].append((letter, stage, k))
            sent.update(_messages(placement, stage, letter, k, received=False))
    return merged


def _messages(
    placement: Placement, stage: int, letter: str, k: int, *, received: bool
) -> list[tuple]:
    """The messages (stream, microbatch, source stage, destination stage of the channels) an
    item of `stage` receives before it or sends after it."""
    row = kind(letter)
    stream = row.receives if received else row.sends
    if stream == ACT:
        peers = placement.into(stage) if received else placement.out(stage)
        return [(ACT, k, *((p, stage) if received else (stage, p))) for p in peers]
    if stream == GRAD:
        peers = placement.grads_from(stage) if received else placement.grads_to(stage)
        return [(GRAD, k, *((stage, p) if received else (p, stage))) for p in peers]
    return []
