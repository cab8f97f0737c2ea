"""A schedule is data: every rank's ordered actions. Torch-free.

Kinds (their rules in one table: `action_kinds.py`): `F`/`B` (forward/backward of one
microbatch at one stage; a split backward is `I`, the gradients with respect to the stage's
inputs, then `W`, those with respect to its weights),
`send`/`recv` (activations `act` forward or gradients `grad` backward, to or from one peer rank),
`allreduce` (the replicas of a stage average their gradients), `clip` (scale the gradients to a
largest norm: over every rank for the synchronous schedules, an all-reduce over `group`; per stage,
with no group, under `pipedream`), `check` (every rank learns whether a loss of the step was NaN or
infinite: an all-reduce of a flag over `group`; the step is then skipped everywhere), `step`
(optimizer update), `push`/`pop` (a weight version is stashed at a forward and dropped after its
backward), `FB` (the two compute actions after it, a forward and a backward part, run as one
overlapped pair: `action_kinds.overlapped`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.action_kinds import (
    ACT,
    ALLREDUCE,
    COMPUTE,
    RECV,
    SEND,
    is_compute,
    kind,
)

__all__ = ["COMPUTE", "Action", "Schedule"]


class Action(NamedTuple):
    """One step of one rank (a named tuple: schedules of large pipelines hold millions).

    `microbatch` is -1 for per-step actions (`allreduce`, `step` of `1f1b` and `gpipe`) and
    the round for the per-round updates of the streaming schedules (`pipedream`: k // replicas;
    `2bw`: the step, k // num_microbatches);
    `peer` and `stream` (`act` or `grad`) are set for `send`/`recv`; `peer_stage` is the stage on
    the other end; `group` lists the ranks of an `allreduce`, which sums the gradients of a tie
    group (`tie`, its index in `program.ties`: every rank of every stage using the tensor) or,
    with `tie` -1, averages the other gradients among the replicas of a stage.
    """

    kind: str
    stage: int
    microbatch: int = -1
    peer: int = -1
    peer_stage: int = -1
    stream: str = ""
    group: tuple[int, ...] = ()
    tie: int = -1

    @property
    def key(self) -> tuple[str, int, int, int]:
        """A message's key, the same for its send and its receive: (stream, microbatch, source
        stage, destination stage) of the channels it belongs to; gradients travel them back."""
        downstream = (self.stream == ACT) == (self.kind == SEND)  # at the channels' source
        pair = (self.stage, self.peer_stage) if downstream else (self.peer_stage, self.stage)
        return (self.stream, self.microbatch, *pair)

    @property
    def is_collective(self) -> bool:
        """Whether the ranks of `group` take part in it together."""
        return kind(self.kind).collective and bool(self.group)

    @property
    def collective(self) -> tuple:
        """What identifies a collective across the ranks that take part in it."""
        if self.kind != ALLREDUCE:  # a clip's norm or a check's flag
            return (self.kind, self.microbatch, self.group)
        if self.tie >= 0:
            return ("tie", self.tie, self.microbatch, self.group)
        return ("replicas", self.stage, self.microbatch, self.group)

    def __str__(self) -> str:
        mb = "" if self.microbatch < 0 else str(self.microbatch)
        if is_compute(self.kind):
            return f"{self.kind}{mb}"
        if self.kind == SEND:
            return f"{self.stream}{mb}>{self.peer}"
        if self.kind == RECV:
            return f"{self.stream}{mb}<{self.peer}"
        if self.kind == ALLREDUCE:
            return f"T{self.tie}.{mb}" if self.tie >= 0 else f"AR{mb}"
        if kind(self.kind).brackets:  # its parts, after it, show their microbatches
            return self.kind
        return f"{self.kind}{mb}"


@dataclass(frozen=True)
class Schedule:
    """Every rank's actions, in order, for one `train_step` (or `flush`) of one plan."""

    kind: str
    num_microbatches: int
    replicas: tuple[int, ...]
    ranks: tuple[tuple[int, ...], ...]  # per stage
    actions: Mapping[int, tuple[Action, ...]] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    training: bool = True  # False: forwards only (evaluation)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` runs (a replica of each)."""
        stages = tuple(s for s, ranks in enumerate(self.ranks) if rank in ranks)
        if stages:
            return stages
        raise ScheduleError(
            f"rank {rank} runs no stage of this {self.kind} schedule (ranks per stage: "
            f"{[list(r) for r in self.ranks]}); start as many ranks as the plan uses"
        )

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The replica of `stage` that runs `microbatch` (round-robin)."""
        return self.ranks[stage][microbatch % self.replicas[stage]]

    def grid(self, mark: Mapping[int, int] | None = None, width: int = 7) -> str:
        """A rank-by-step table of the actions; `mark[rank] = step` flags a cell with `!`."""
        mark = mark or {}
        steps = max((len(a) for a in self.actions.values()), default=0)
        lines = ["rank " + "".join(f"{i:<{width}}" for i in range(steps))]
        for rank in sorted(self.actions):
            cells = []
            for i, action in enumerate(self.actions[rank]):
                text = ("!" if mark.get(rank) == i else "") + str(action)
                cells.append(f"{text:<{width}}")
            lines.append(f"{rank:<5}" + "".join(cells))
        return "\n".join(lines)
