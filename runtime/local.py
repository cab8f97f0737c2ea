"""The local executor: every rank of a schedule in one process, with the distributed semantics.

Each rank gets its own copy of each of its stage modules and optimizers; messages go through a
shared mailbox. Actions run in the order the schedule allows (a receive once its message is sent, an
all-reduce once its whole group reached it), exactly as the validator executes them. For debugging
and as the reference the distributed executor is compared with."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
import torch.nn as nn

from pdcompile.codegen.staged_program import StagedProgram
from pdcompile.errors import ScheduleError
from pdcompile.runtime.comm import LocalComm
from pdcompile.runtime.microbatches import Batch
from pdcompile.runtime.pipeline import Pipeline, program_schedule
from pdcompile.runtime.rank_workers import RankWorkers
from pdcompile.runtime.worker import (
    LossFn,
    OptimizerFactory,
    SchedulerFactory,
    StageWorker,
)
from pdcompile.schedules import Action, PipelineSchedule, check_nonfinite


class LocalPipeline(Pipeline):
    """Train a StagedProgram with a schedule, all ranks in this process.

    Args:
        program: the stage modules (copied per rank: the program is not changed).
        schedule: a registered schedule (`pdcompile.schedules()`) or a `PipelineSchedule`.
        num_microbatches: microbatches per `train_step`.
        loss_fn: `loss_fn(output, target) -> scalar`, on the last stage.
        optimizer: a factory `params -> torch.optim.Optimizer`, applied per stage replica.
        stash: weight stashing under `pipedream` (False only to show what it prevents).
        vertical_sync: `pipedream` with vertical sync (docs/runtime.md).
        clip_grad_norm: the largest gradient norm: over the whole model, or as the schedule
            groups it (`pipedream`: per stage, stages sharing tied weights together).
        lr_scheduler: a factory `optimizer -> LRScheduler` per rank, stepped after each update.
        autocast: the dtype of `torch.autocast` around every forward (None: off).
        nonfinite: a NaN or infinite loss raises `LossError` ("raise") or skips the step on
            every rank ("skip": synchronous schedules).
    """

    def __init__(
        self,
        program: StagedProgram,
        *,
        schedule: str | PipelineSchedule,
        num_microbatches: int,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        stash: bool = True,
        vertical_sync: bool = False,
        clip_grad_norm: float | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        autocast: torch.dtype | None = None,
        nonfinite: str = "raise",
    ) -> None:
        check_nonfinite(schedule, nonfinite)
        mailbox = LocalComm(-1)
        workers: list[StageWorker] = []
        layout = program_schedule(program, schedule, num_microbatches)
        for stage, ranks in enumerate(layout.ranks):
            for rank in ranks:
                workers.append(StageWorker(
                    program, stage, copy.deepcopy(program.stages[stage]), mailbox.for_rank(rank),
                    loss_fn=loss_fn, optimizer=optimizer, schedule=schedule,
                    num_microbatches=num_microbatches, stash=stash,
                    vertical_sync=vertical_sync, clip_grad_norm=clip_grad_norm,
                    lr_scheduler=lr_scheduler, autocast=autocast, nonfinite=nonfinite,
                ))  # fmt: skip
        super().__init__(program, workers, schedule=schedule, num_microbatches=num_microbatches)

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
                if a.kind == "recv" and not comm.has(a.peer, a.key):
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
