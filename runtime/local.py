"""The local executor: every rank of a schedule in one process, with the distributed semantics.

Each rank gets its own copy of each of its stage modules and optimizers; messages go through a
shared mailbox. Actions run in the order the schedule allows (a receive once its message is sent, an
all-reduce once its whole group reached it), exactly as the validator executes them. For debugging
and as the reference the distributed executor is compared with."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch.nn as nn

from pdcompile.core.errors import ScheduleError
from pdcompile.lowering.staged_program import StagedProgram
from pdcompile.runtime.comm import LocalComm
from pdcompile.runtime.microbatches import Batch
from pdcompile.runtime.pipeline import Pipeline, executor_schedule
from pdcompile.runtime.rank_workers import RankWorkers
from pdcompile.runtime.train_config import TrainConfig
from pdcompile.runtime.worker import StageWorker
from pdcompile.scheduling import Action, PipelineSchedule, Schedule
from pdcompile.scheduling.action_kinds import RECV


class LocalPipeline(Pipeline):
    """Train a StagedProgram with a schedule, all ranks in this process.

    Args:
        program: the stage modules (copied per rank: the program is not changed).
        schedule: a registered schedule (`pdcompile.schedules()`) or a `PipelineSchedule`.
        num_microbatches: microbatches per `train_step` (with `built`: its count).
        config: the training settings (`TrainConfig`: loss, optimizer factory applied per stage
            replica, scheduler factory per rank, clipping over the whole model or as the
            schedule groups it, autocast, non-finite losses, vertical sync, stashing).
        built: the schedule of `program` under `schedule` and `config`, built once
            (`program_schedule`); None: built here.
        settings: instead of `config`, its fields as keywords (`loss_fn=`, `optimizer=`, ...).
    """

    def __init__(
        self,
        program: StagedProgram,
        *,
        schedule: str | PipelineSchedule,
        num_microbatches: int | None = None,
        config: TrainConfig | None = None,
        built: Schedule | None = None,
        **settings: Any,
    ) -> None:
        config = TrainConfig.given(config, settings)
        rules, built = executor_schedule(program, schedule, num_microbatches, config, built)
        mailbox = LocalComm(-1)
        workers = [
            StageWorker(program, stage, copy.deepcopy(program.stages[stage]),
                        mailbox.for_rank(rank), config, rules, built.num_microbatches)
            for stage, ranks in enumerate(built.ranks)
            for rank in ranks
        ]  # fmt: skip
        super().__init__(program, workers, rules, built)

    def _execute(
        self,
        actions: Mapping[int, Sequence[Action]],
        position: dict[int, int],
        stop: dict[int, int] | None,
    ) -> None:
        _run(self.ranks, actions, position, stop)

    def _loss(self, batch: Batch, first: int) -> float:
        total, weight = self._local_loss(batch, first)
        return total / weight

    def stage_modules(self) -> dict[tuple[int, int], nn.Module]:
        """Each (rank, stage)'s trained module (flushes first)."""
        self.flush()
        return {key: w.module for key, w in self.workers.items()}


def _run(
    workers: dict[int, RankWorkers],
    actions: Mapping[int, Sequence[Action]],
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
                if a.kind == RECV and not comm.has(a.peer, a.key):
                    break
                if a.is_collective:
                    if not all(
                        position[m] < stop[m] and _at(actions[m], position[m], a) for m in a.group
                    ):
                        break
                    for member in a.group:
                        workers[member].run(actions[member][position[member]])
                    for member in a.group:
                        workers[member].finish(actions[member][position[member]])
                        position[member] += 1
                    moved = True
                    continue
                workers[rank].run(a)
                position[rank] += 1
                moved = True
        if not moved:
            waiting = {r: str(actions[r][p]) for r, p in position.items() if p < stop[r]}
            raise ScheduleError(f"local executor stalled; ranks wait at {waiting}")


def _at(actions: Sequence[Action], position: int, collective: Action) -> bool:
    """Whether a rank stands at (its part of) the same all-reduce (`position` before its
    stop)."""
    action = actions[position]
    return action.is_collective and action.collective == collective.collective
