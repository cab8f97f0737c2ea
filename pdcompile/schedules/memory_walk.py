"""What a rank holds, read off its order: the memory counts of a kind without closed forms.
Torch-free.

A rank's compute items are walked in order with the action table's `holds` (a forward adds a
microbatch holding all its activations, a fused backward frees it, a split backward's I leaves
what its W reads, the W frees that): the most microbatches held at once, the most holding all
their activations, the same while the rank holds gradients (from its first item that
`accumulates` them to the update), and the forwards before its first other item (its warm-up).
A stream is walked over enough of its endless order to reach its steady state, its gradients
freed at each round's update.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from pdcompile.schedules.action_kinds import kind


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
