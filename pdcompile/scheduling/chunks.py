"""Orders shared by the schedules that split the backward or run several stages per rank.
Torch-free.

A layout with `chunks` v: p ranks each run v stages (model chunks), one replica each. Placed
round-robin (Megatron's virtual pipeline), stage i runs on the rank of stage i mod p; in a V
(`zb-v`), stages s and 2p - 1 - s share a rank. `split_order` is one replica's order with the
backward split into I and W, the W's deferred to fill the bubbles (ZB-H1, ZB-H2);
`interleaved_order` is Megatron's interleaved order of one rank, fused or split;
`v_order` the ZB-V order of one rank.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Sequence
from typing import Any

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.action_kinds import B, F, I, W

Item = tuple[str, int, int]  # (kind, stage, microbatch)


def ranks_and_chunks(ranks: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(p, v) of a layout: p ranks, each running v stages. One stage per rank (replicas
    allowed) is v = 1; several stages per rank need one replica each."""
    ranks = [tuple(r) for r in ranks]
    used = {r for rs in ranks for r in rs}
    if sum(len(rs) for rs in ranks) == len(used):  # every rank runs one stage
        return len(used), 1
    if any(len(rs) != 1 for rs in ranks) or len(ranks) % len(used):
        raise ScheduleError(
            f"stages on ranks {[list(r) for r in ranks]}: a rank running several stages needs "
            f"one replica per stage and the same number of stages on every rank"
        )
    return len(used), len(ranks) // len(used)


def check_round_robin(name: str, ranks: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(p, v) of a layout with stage i on the rank of stage i mod p (v = 1: one stage per
    rank); `ScheduleError` otherwise."""
    p, v = ranks_and_chunks(ranks)
    if v > 1 and any(tuple(ranks[i]) != tuple(ranks[i % p]) for i in range(len(ranks))):
        raise ScheduleError(
            f"{name} with {v} stages per rank places stage i on the rank of stage i mod {p} "
            f"(Megatron's virtual pipeline), got ranks {[list(r) for r in ranks]}; plan with "
            f"chunks={v}, which places them so"
        )
    return p, v


def check_v_shape(name: str, ranks: Sequence[Sequence[int]]) -> int:
    """p of a layout of 2p stages, one replica each, stages s and 2p - 1 - s on one rank;
    `ScheduleError` otherwise."""
    ranks = [tuple(r) for r in ranks]
    p = len(ranks) // 2
    firsts = [r for rs in ranks[:p] for r in rs]
    v_shaped = (
        len(ranks) == 2 * p
        and all(len(rs) == 1 for rs in ranks)
        and len(set(firsts)) == p
        and all(ranks[s] == ranks[2 * p - 1 - s] for s in range(p))
    )
    if not v_shaped:
        raise ScheduleError(
            f"{name} runs two stages per rank in a V: 2p stages of one replica each, stage s "
            f"and stage 2p - 1 - s on the same rank; got ranks {[list(r) for r in ranks]} "
            "(plan with schedule='zb-v', which places them so)"
        )
    return p


class VPlacement(abc.ABC):
    """A mixin for a `PipelineSchedule` whose 2p stages sit in a V on p ranks: stages s and
    2p - 1 - s on rank s (`chunk_rank`, two stages per rank by definition), checked
    (`check_layout`)."""

    name: str
    default_chunks = 2
    fewest_beyond: int = 0  # microbatches it needs: at least 2p + this
    fewest_why: str = ""  # what the message says of that count

    def check(
        self, replicas: Sequence[int], num_microbatches: int, ties: Sequence[Sequence[int]] = ()
    ) -> None:
        super().check(replicas, num_microbatches)  # type: ignore[misc]
        least = len(replicas) + self.fewest_beyond
        if len(replicas) % 2 or num_microbatches < least:
            beyond = f" {self.fewest_beyond:+d}".replace("+", "+ ").replace("-", "- ")
            raise ScheduleError(
                f"{self.name} runs 2p stages on p ranks and needs at least 2p"
                f"{beyond if self.fewest_beyond else ''} microbatches{self.fewest_why}; got "
                f"{len(replicas)} stages and {num_microbatches} microbatches"
            )

    def check_layout(self, ranks: Sequence[Sequence[int]], num_microbatches: int) -> None:
        check_v_shape(self.name, ranks)

    def rank_orders(self, placement: Any) -> dict[int, list[Item]]:
        """Each rank's `v_rank_order` (its position r in the V, both its stages)."""
        p = check_v_shape(self.name, placement.ranks)
        total = placement.total
        return {placement.ranks[r][0]: self.v_rank_order(p, total, r) for r in range(p)}

    @abc.abstractmethod
    def v_rank_order(self, p: int, num_microbatches: int, position: int) -> list[Item]:
        """The order of the rank at `position` of a V of 2p stages (the kind's own)."""

    def chunk_rank(self, stage: int, num_ranks: int, chunks: int) -> int:
        """The V: stages s and 2p - 1 - s on rank s."""
        if chunks != 2:
            raise ScheduleError(f"{self.name} runs two stages per rank (chunks=2), got {chunks}")
        return v_position(stage, num_ranks)


def v_position(stage: int, p: int) -> int:
    """The rank (its position in the V) running `stage` of a V of 2p stages."""
    return stage if stage < p else 2 * p - 1 - stage


def split_order(mine: Sequence[int], warmup: int, defer: int) -> list[tuple[str, int]]:
    """One replica's compute with a split backward: `warmup` forwards, then per microbatch a
    forward and the input-gradient part I of the oldest one, then the remaining I's; each I
    is followed by the weight part W of the microbatch `defer` I's earlier (the first `defer`
    W's wait), and the W's still waiting come last.

    >>> split_order(range(3), 1, 1)
    [('F', 0), ('F', 1), ('I', 0), ('F', 2), ('I', 1), ('W', 0), ('I', 2), ('W', 1), ('W', 2)]
    """
    n = len(mine)
    w = min(warmup, n)
    order = [(F, k) for k in mine[:w]]
    waiting: deque[int] = deque()
    for j in range(n):
        if w + j < n:
            order.append((F, mine[w + j]))
        order.append((I, mine[j]))
        waiting.append(mine[j])
        if j >= defer:
            order.append((W, waiting.popleft()))
    return order + [(W, k) for k in waiting]


def interleaved_order(
    p: int, v: int, num_microbatches: int, position: int, warmup: int, *,
    split: bool = False, defer: int = 0,
) -> list[Item]:  # fmt: skip
    """Megatron's interleaved order of the rank at `position` (0 to p - 1) over its v stages
    (position, position + p, ...) and M microbatches, M a multiple of p.

    Forwards go in groups of p microbatches through chunk 0, then the same p through chunk
    1, ..., then the next p; backwards alike from the last chunk down. After `warmup`
    forwards, each forward is followed by the oldest backward (fused B, or with `split` the
    input part I, then the weight part W of the one `defer` backwards earlier).
    """
    total = v * num_microbatches

    def item(j: int, backward: bool) -> tuple[int, int]:
        chunk = (j // p) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk * p + position, (j // (p * v)) * p + j % p

    w = min(warmup, total)
    order: list[Item] = [(F, *item(j, False)) for j in range(w)]
    waiting: deque[tuple[int, int]] = deque()
    for j in range(total):
        if w + j < total:
            order.append((F, *item(w + j, False)))
        stage, k = item(j, True)
        if not split:
            order.append((B, stage, k))
            continue
        order.append((I, stage, k))
        waiting.append((stage, k))
        if j >= defer:
            order.append((W, *waiting.popleft()))
    return order + [(W, s, k) for s, k in waiting]


def v_order(p: int, num_microbatches: int, position: int) -> list[Item]:
    """The ZB-V order (Qi et al., ICLR'24, section 6) of the rank at `position` (0 to p - 1),
    which runs stage `position` (down the V) and stage 2p - 1 - position (back up).

    Warm-up: 2(p - position) - 1 forwards down, then `position` pairs of a forward up and one
    down, then p - position times a forward up with its I and W. Steady: a forward down with
    the oldest I and W down, a forward up with the oldest I and W up. Cool-down: `position`
    pairs of I's (down, up), p - position times an I down and a W down, then the W's still
    due, up first. Orders are built for at least 2p - 1 microbatches (what the V needs to
    fill) and the microbatches beyond M dropped.
    """
    n = max(2 * p - 1, num_microbatches)
    down, up = position, 2 * p - 1 - position
    order: list[Item] = []
    count = {(F, down): 0, (F, up): 0, (I, down): 0, (I, up): 0}
    weights = {down: 0, up: 0}

    def run(kind: str, stage: int) -> None:
        if kind == W:
            order.append((W, stage, weights[stage]))
            weights[stage] += 1
            return
        order.append((kind, stage, count[(kind, stage)]))
        count[(kind, stage)] += 1

    for _ in range(2 * (p - position) - 1):
        run(F, down)
    for _ in range(position):
        run(F, up)
        run(F, down)
    for _ in range(p - position):
        run(F, up)
        run(I, up)
        run(W, up)
    while count[(F, up)] < count[(F, down)] or count[(F, down)] < n:
        if count[(F, down)] < n:
            run(F, down)
        run(I, down)
        run(W, down)
        run(F, up)
        run(I, up)
        run(W, up)
    for _ in range(position):
        run(I, down)
        run(I, up)
    for _ in range(p - position):
        run(I, down)
        run(W, down)
    while weights[up] < count[(I, up)]:
        run(W, up)
    while weights[down] < count[(I, down)]:
        run(W, down)
    return [item for item in order if item[2] < num_microbatches]
