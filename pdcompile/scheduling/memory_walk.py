"""What a rank holds, read off its order: the memory counts of a kind without closed forms.
Torch-free.

A rank's compute items are walked in order with the action table's `holds` (a forward adds a
microbatch holding all its activations, a fused backward frees it, a split backward's I leaves
what its W reads, the W frees that): the most microbatches held at once, the most holding all
their activations, the same while the rank holds gradients (from its first item that
`accumulates` them to the update), and the forwards before its first other item (its warm-up).
An overlapped pair's bracket holds nothing: its parts are walked in order, the forward first, so
the forward's activations are counted before the backward frees its own (on a GPU running both
at once they are held together too).
A stream is walked over enough of its endless order to reach its steady state, its gradients
freed at each round's update.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.action_kinds import kind
from pdcompile.scheduling.placement import ENDLESS, Item, Placement

if TYPE_CHECKING:
    from pdcompile.scheduling.base import PipelineSchedule


class Walked(NamedTuple):
    """What one rank's order holds at most (docs in the module)."""

    in_flight: int  # microbatches held at once, all activations or W's part
    full: int  # of them, holding all their activations
    graded_full: int  # while gradients are held
    graded_in_flight: int
    warmup: int  # forwards before the first other compute item


def walk(
    items: Iterable[tuple[str, int, int]], round_of: dict[int, tuple[int, int]] | None = None
) -> Walked:
    """Walk (kind, stage, microbatch) `items` in order. `round_of`: for a stream, per stage
    (its replicas, its round size): the update after a stage's last microbatch of each round
    frees the gradients (None: they are held to the end)."""
    full = waiting = most = most_full = graded_full = graded_total = 0
    warmup: int | None = None
    forwards = 0
    grads: set[int] = set()  # stages holding gradients
    for letter, stage, k in items:
        row = kind(letter)
        if not row.is_compute:  # an overlapped pair's bracket: its parts follow
            continue
        if row.starts:
            forwards += 1
        elif warmup is None:
            warmup = forwards
        full += row.holds[0]
        waiting += row.holds[1]
        most, most_full = max(most, full + waiting), max(most_full, full)
        if row.accumulates:
            grads.add(stage)
        if grads:
            graded_full, graded_total = max(graded_full, full), max(graded_total, full + waiting)
        if round_of is not None and row.ends and stage in round_of:
            group, size = round_of[stage]
            if (k + group) // size > k // size:  # the replica's last of the round: the update
                grads.discard(stage)
    return Walked(most, most_full, graded_full, graded_total,
                  forwards if warmup is None else warmup)  # fmt: skip


@functools.lru_cache(maxsize=4096)
def walks(
    rules: PipelineSchedule, replicas: tuple[int, ...], num_microbatches: int, chunks: int
) -> tuple[Walked, ...] | None:
    """Per stage, the `Walked` of its replicas' ranks (their most; with chunks > 1, of the
    rank running it), once per schedule and layout (the solvers ask for every stage of a few
    layouts); None where the kind does not run that layout."""
    placement = _layout(rules, replicas, num_microbatches, chunks)
    streaming = rules.streaming
    total = ENDLESS if streaming else num_microbatches
    try:
        rules.check_layout(placement.ranks, num_microbatches)
        orders = rules.rank_orders(Placement(placement.ranks, placement.edges, num_microbatches,
                                             total))  # fmt: skip
        if streaming:
            walked = _walk_stream(rules, placement, orders)
        else:
            walked = {rank: walk(orders[rank]) for rank in placement.world}
    except ScheduleError:
        return None
    return tuple(
        Walked(*(max(field) for field in zip(*(walked[r] for r in rs), strict=True)))
        for rs in placement.ranks
    )


def _walk_stream(
    rules: PipelineSchedule, placement: Placement, orders: Mapping[int, Sequence[Item]]
) -> dict[int, Walked]:
    """A stream never drains: each rank's endless order walked past its warm-up and two whole
    rounds, the gradients freed at each round's update."""
    rounds = {s: (r, rules.weights.round_size(placement, s))
              for s, r in enumerate(placement.replicas)}  # fmt: skip
    longest = max(size for _, size in rounds.values())
    walked = {}
    for rank in placement.world:
        order = orders[rank]
        warmup = next(i for i in itertools.count() if not kind(order[i][0]).starts)
        count = rules.items_per_microbatch * (warmup + 2 * longest + 2)
        walked[rank] = walk((order[i] for i in range(count)), rounds)
    return walked


def _layout(
    rules: PipelineSchedule, replicas: tuple[int, ...], num_microbatches: int, chunks: int
) -> Placement:
    """Stages with `replicas` one per rank in a chain, or, with chunks > 1, placed as
    `plan(..., chunks=)` places them (one replica each)."""
    if chunks == 1:
        return Placement.straight(replicas, num_microbatches)
    p = len(replicas) // chunks
    ranks = tuple((rules.chunk_rank(i, p, chunks),) for i in range(len(replicas)))
    edges = {(s, s + 1): True for s in range(len(replicas) - 1)}
    return Placement(ranks, edges, num_microbatches)
