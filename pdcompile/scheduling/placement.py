"""Where a schedule's stages sit and what one step runs: the one argument of a schedule's orders.
Torch-free.

A `Placement` is the ranks of every stage (its replicas, in order), the stage pairs that exchange
tensors and the microbatches: `num_microbatches` per step, `total` in the orders asked for (a
streaming schedule's endless stream: `ENDLESS`). Microbatch k of stage s runs on replica
k mod r_s.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from pdcompile.core.errors import ScheduleError

ENDLESS = sys.maxsize  # microbatches of a stream: more than any run gives
Item = tuple[str, int, int]  # a compute item of a rank's order: (kind, stage, microbatch)


@dataclass(frozen=True)
class Placement:
    """The ranks of each stage, the channels and the microbatches of a schedule's orders.

    Attributes:
        ranks: per stage, the ranks of its replicas (a tuple, or a `range`).
        edges: (source stage, destination stage) -> whether gradients flow back along it.
        num_microbatches: microbatches per step (M).
        total: microbatches the orders cover (M, M x steps, or `ENDLESS`); 0: M.
    """

    ranks: tuple[Sequence[int], ...]
    edges: Mapping[tuple[int, int], bool] = field(default_factory=dict, compare=False)
    num_microbatches: int = 1
    total: int = 0

    def __post_init__(self) -> None:
        ranks = tuple(r if isinstance(r, range) else tuple(r) for r in self.ranks)
        object.__setattr__(self, "ranks", ranks)
        if not self.total:
            object.__setattr__(self, "total", self.num_microbatches)

    @classmethod
    def straight(cls, replicas: Sequence[int], num_microbatches: int, total: int = 0) -> Placement:
        """Stages with `replicas`, on consecutive ranks (each stage's a `range`: a stage of
        100,000 replicas costs no more than one of one), each sending to the next."""
        ranks, first = [], 0
        for r in replicas:
            ranks.append(range(first, first + r))
            first += r
        edges = {(s, s + 1): True for s in range(len(replicas) - 1)}
        return cls(tuple(ranks), edges, num_microbatches, total)

    @cached_property
    def replicas(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.ranks)

    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    @cached_property
    def world(self) -> tuple[int, ...]:
        """Every rank of the placement, in order."""
        return tuple(sorted({r for rs in self.ranks for r in rs}))

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` runs a replica of."""
        return tuple(s for s, rs in enumerate(self.ranks) if rank in rs)

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank of the replica of `stage` that runs `microbatch` (round-robin)."""
        return self.ranks[stage][microbatch % self.replicas[stage]]

    def mine(self, rank: int, stage: int) -> range:
        """The microbatches the replica of `stage` on `rank` runs, of `total`."""
        return range(self.ranks[stage].index(rank), self.total, self.replicas[stage])

    @property
    def one_stage_per_rank(self) -> bool:
        return len(self.world) == sum(self.replicas)

    def into(self, stage: int) -> tuple[int, ...]:
        """The stages whose activations `stage` receives."""
        return tuple(sorted(src for src, dst in self.edges if dst == stage))

    def out(self, stage: int) -> tuple[int, ...]:
        """The stages `stage` sends its activations to."""
        return tuple(sorted(dst for src, dst in self.edges if src == stage))

    def grads_to(self, stage: int) -> tuple[int, ...]:
        """The stages `stage` sends gradients back to."""
        return tuple(sorted(a for (a, d), grads in self.edges.items() if d == stage and grads))

    def grads_from(self, stage: int) -> tuple[int, ...]:
        """The stages whose gradients `stage` receives back."""
        return tuple(sorted(d for (a, d), grads in self.edges.items() if a == stage and grads))

    def chunks(self) -> tuple[int, int]:
        """(p, v): p ranks, each running v stages. One stage per rank (replicas allowed) is
        v = 1; several stages per rank need one replica each.

        Raises:
            ScheduleError: ranks run different numbers of stages, or a rank running several
                holds a replicated one.
        """
        if self.one_stage_per_rank:
            return len(self.world), 1
        if any(r != 1 for r in self.replicas) or self.num_stages % len(self.world):
            raise ScheduleError(
                f"stages on ranks {[list(r) for r in self.ranks]}: a rank running several "
                "stages needs one replica per stage and the same number of stages on every rank"
            )
        return len(self.world), self.num_stages // len(self.world)
