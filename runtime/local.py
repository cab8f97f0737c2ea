"""The local executor: every rank of a schedule in one process, with the distributed semantics.

Each rank gets its own copy of its stage module and optimizer; messages go through a shared
mailbox. Actions run in the order the schedule allows (a receive once its message is sent, an
all-reduce once its whole group reached it), exactly as the validator executes them. For
debugging and as the reference the distributed executor is compared with.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from pdcompile.errors import ScheduleError
from pdcompile.runtime.actions import Action, Schedule
from pdcompile.runtime.comm import LocalComm
from pdcompile.runtime.schedules import build_schedule
from pdcompile.runtime.validate import validate_schedule
from pdcompile.runtime.versions import warmup
from pdcompile.runtime.worker import LossFn, OptimizerFactory, StageWorker, split_batch
from pdcompile.staged_program import StagedProgram


def program_schedule(program: StagedProgram, kind: str, num_microbatches: int) -> Schedule:
    """The validated schedule of `program` under its plan's ranks."""
    edges: dict[tuple[int, int], bool] = {}
    for c in program.channels:
        pair = (c.src_stage, c.dst_stage)
        edges[pair] = edges.get(pair, False) or (c.kind == "tensor" and c.requires_grad)
    ranks = [stage.ranks for stage in program.plan.stages]
    ties = [tie.stages for tie in program.ties]
    schedule = build_schedule(kind, ranks, edges, num_microbatches, ties)
    validate_schedule(schedule)
    return schedule


class LocalPipeline:
    """Train a StagedProgram with a schedule, all ranks in this process.

    Args:
        program: the stage modules (copied per rank: the program is not changed).
        schedule: "1f1b", "gpipe", "pipedream" or "2bw".
        num_microbatches: microbatches per `train_step`.
        loss_fn: `loss_fn(output, target) -> scalar`, on the last stage.
        optimizer: a factory `params -> torch.optim.Optimizer`, applied per stage replica.
        stash: weight stashing under `pipedream` (False only to show what it prevents).

    Under `pipedream` minibatches stay in flight across `train_step` calls: each call runs every
    rank's actions up to the first forward of a minibatch it has not been given yet; `flush()`
    completes the rest (and the next call fills the pipeline again).
    """

    def __init__(
        self,
        program: StagedProgram,
        *,
        schedule: str,
        num_microbatches: int,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        stash: bool = True,
    ) -> None:
        self.program = program
        self.kind = schedule
        self.num_microbatches = num_microbatches
        self.schedule = program_schedule(program, schedule, num_microbatches)
        mailbox = LocalComm(-1)
        self.workers: dict[int, StageWorker] = {}
        for stage, ranks in enumerate(self.schedule.ranks):
            for rank in ranks:
                self.workers[rank] = StageWorker(
                    program, stage, copy.deepcopy(program.stages[stage]), mailbox.for_rank(rank),
                    loss_fn=loss_fn, optimizer=optimizer, schedule_kind=schedule, stash=stash,
                )  # fmt: skip
        self.started = 0  # pipedream: minibatches given since the last flush
        self.position = dict.fromkeys(self.workers, 0)  # pipedream: actions done since then

    def train_step(self, args: Sequence[Any], targets: Any, kwargs: dict | None = None) -> float:
        """One step over the batch; returns the loss (weighted mean over its microbatches)."""
        pipedream = self.kind == "pipedream"
        batch = split_batch(
            args, kwargs or {}, targets, self.num_microbatches, weighted=not pipedream
        )
        first = self.started if pipedream else 0
        for worker in self.workers.values():
            worker.add_microbatches(batch, first)
        if pipedream:
            self.started += self.num_microbatches
            stream = self._stream(self.started + self._lookahead())
            stop = {r: _cut(a, self.started) for r, a in stream.actions.items()}
            _run(self.workers, stream.actions, self.position, stop)
        else:
            _run(self.workers, self.schedule.actions, dict.fromkeys(self.workers, 0), None)
        losses = {k: v for w in self.workers.values() if w.last for k, v in w.losses.items()}
        mine = range(first, first + self.num_microbatches)
        return sum(losses[k] * batch.weights[k - first] for k in mine) / sum(batch.weights)

    def flush(self) -> None:
        """Complete every minibatch in flight (`pipedream`; a no-op for the others)."""
        if self.kind != "pipedream" or not self.started:
            return
        _run(self.workers, self._stream(self.started).actions, self.position, None)
        self.started = 0
        self.position = dict.fromkeys(self.workers, 0)

    def _stream(self, minibatches: int) -> Schedule:
        return program_schedule(self.program, self.kind, minibatches)

    def _lookahead(self) -> int:
        """Minibatches past the given ones that every replica's warm-up fits in (so that the
        stream's prefix is that of an endless pipeline), a multiple of every replica count."""
        replicas = self.schedule.replicas
        period = math.lcm(*replicas)
        deepest = max(warmup(replicas, s) for s in range(len(replicas)))
        return period * (deepest + 1) * max(replicas)

    def stage_modules(self) -> dict[int, nn.Module]:
        """Each rank's trained module."""
        return {rank: w.module for rank, w in self.workers.items()}


def _cut(actions: Sequence[Action], bound: int) -> int:
    """The index of a rank's first action that needs a minibatch >= bound."""
    for i, a in enumerate(actions):
        forward = a.kind in ("F", "push") or (a.kind in ("send", "recv") and a.stream == "act")
        if forward and a.microbatch >= bound:
            return i
    return len(actions)


def _run(
    workers: dict[int, StageWorker],
    actions: dict[int, tuple[Action, ...]],
    position: dict[int, int],
    stop: dict[int, int] | None,
) -> None:
    """Run every rank from `position` (updated) to `stop` in an order the actions allow."""
    stop = stop or {r: len(a) for r, a in actions.items()}
    while any(position[r] < stop[r] for r in actions):
        moved = False
        for rank in actions:
            while position[rank] < stop[rank]:
                a = actions[rank][position[rank]]
                comm = workers[rank].comm
                if a.kind == "recv" and not comm.has(a.peer, _key(a)):
                    break
                if a.kind == "allreduce":
                    if not all(
                        position[m] < stop[m] and _at(actions[m], position[m], a) for m in a.group
                    ):
                        break
                    for member in a.group:
                        workers[member].run(actions[member][position[member]])
                        position[member] += 1
                    moved = True
                    continue
                workers[rank].run(a)
                position[rank] += 1
                moved = True
        if not moved:
            waiting = {r: str(actions[r][p]) for r, p in position.items() if p < stop[r]}
            raise ScheduleError(f"local executor stalled; ranks wait at {waiting}")


def _at(actions: Sequence[Any], position: int, collective: Any) -> bool:
    """Whether a rank stands at (its part of) the same all-reduce."""
    if position >= len(actions) or actions[position].kind != "allreduce":
        return False
    return actions[position].collective == collective.collective


def _key(a: Any) -> tuple:
    """The mailbox key of a receive (as its sender's `send` files it)."""
    if a.stream == "act":
        return (a.stream, a.microbatch, a.peer_stage, a.stage)
    return (a.stream, a.microbatch, a.stage, a.peer_stage)
