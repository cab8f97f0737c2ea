"""Microbatches split over a stage's replicas: how many each runs per step (`replica_split`),
and a stage whose replicas run unequal shares (`UnevenSplit`: who idles, by how much, and the
counts that would even it out). Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def replica_split(num_microbatches: int, replicas: int) -> tuple[int, ...]:
    """Microbatches each replica of a stage runs per step: microbatch k goes to replica
    k mod r (`schedules.builder`), so the first M mod r replicas run one more.

    >>> replica_split(8, 3)
    (3, 3, 2)
    """
    whole, extra = divmod(num_microbatches, replicas)
    return tuple(whole + (i < extra) for i in range(replicas))


@dataclass(frozen=True)
class UnevenSplit:
    """A stage whose replicas run different numbers of microbatches per step: the busiest run
    ceil(M / r), the others floor(M / r), and wait for them (the step, its all-reduce and the
    next stage's inputs do)."""

    stage: int
    ranks: tuple[int, ...]
    counts: tuple[int, ...]  # microbatches per replica, in the order of `ranks`

    @property
    def num_microbatches(self) -> int:
        return sum(self.counts)

    @property
    def short_ranks(self) -> tuple[int, ...]:
        """The ranks of the replicas that run fewer microbatches than the busiest."""
        most = max(self.counts)
        return tuple(r for r, c in zip(self.ranks, self.counts, strict=True) if c < most)

    @property
    def idle_share(self) -> float:
        """The share of the busiest replica's compute time a short replica idles,
        1 - floor(M / r) / ceil(M / r)."""
        return 1 - min(self.counts) / max(self.counts)

    def fixes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the next two microbatch counts the replica count divides, the replica counts that
        divide the microbatch count)."""
        m, r = self.num_microbatches, len(self.counts)
        above = -(-m // r) * r
        return (above, above + r), tuple(d for d in range(1, m + 1) if m % d == 0)

    def describe(self, rank_idle: Sequence[float] = ()) -> str:
        """One sentence: the split, the short replicas' idle share (with the simulated idle of
        the short and the other ranks, from `rank_idle` per rank, when given) and the way
        out."""
        m, r = self.num_microbatches, len(self.counts)
        (one, two), divisors = self.fixes()
        shown = divisors if len(divisors) <= 8 else (*divisors[:7], "...")
        short = self.short_ranks
        simulated = ""
        if max(self.ranks) < len(rank_idle):
            full = tuple(rank for rank in self.ranks if rank not in short)
            parts = [
                f"{_rank_list(ranks)} {max(rank_idle[rank] for rank in ranks):.0%}"
                for ranks in (short, full)
                if ranks
            ]
            simulated = f" (simulated idle: {' against '.join(parts)})"
        return (
            f"stage {self.stage}'s {r} replicas ({_rank_list(self.ranks)}) split {m} "
            f"microbatch{'es' if m != 1 else ''} {'/'.join(map(str, self.counts))}: "
            f"{_rank_list(short)} {'runs' if len(short) == 1 else 'run'} {min(self.counts)} to "
            f"the others' {max(self.counts)} and {'idles' if len(short) == 1 else 'idle'} "
            f"{self.idle_share:.0%} of the stage's compute time{simulated}; "
            f"use a multiple of {r} microbatches (e.g. num_microbatches={one} or {two}), or "
            f"replica counts dividing {m} (replica_counts=({', '.join(map(str, shown))}))"
        )


def _rank_list(ranks: Sequence[int]) -> str:
    """`rank 3`, `ranks 1-2` or `ranks 1, 4`."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
