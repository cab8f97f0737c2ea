"""The distributed executor: this process is one rank, talking to the others over
torch.distributed (gloo on CPUs, NCCL on GPUs), started by `torchrun` or by tests.

Each rank builds the same validated schedule from the program and walks its own actions in
order: a receive waits (with a timeout) for its message, a send never waits, an all-reduce
waits for its group. Receives are posted a window ahead (`RECEIVES_AHEAD`), so the buffers
held stay bounded however many microbatches a step has. At the end of a call, the rank waits
for its sends whose receives the peers have posted by then (short waits that release their
buffers); the others stay in flight.
Every rank passes the same batch to `train_step`; stage 0 uses the inputs, the last stage the
targets, and every rank gets the loss back: each last-stage rank sends its share to the others
(messages, not an all-reduce: no rank waits for a slower one to finish its step). A rank whose
action fails sends the error's text in place of each message it still owed in the step, so the
ranks waiting for them raise at once (`StageCommError` naming it) instead of waiting for their
timeout.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from pdcompile.core.errors import PipelineTimeoutError
from pdcompile.core.message_buffers import RECEIVES_AHEAD
from pdcompile.lowering.staged_program import Channel, StagedProgram
from pdcompile.runtime.comm import Key
from pdcompile.runtime.distributed import DistributedComm
from pdcompile.runtime.microbatches import Batch
from pdcompile.runtime.pipeline import Pipeline, executor_schedule
from pdcompile.runtime.train_config import TrainConfig
from pdcompile.runtime.worker import StageWorker
from pdcompile.scheduling import Action, PipelineSchedule, Schedule
from pdcompile.scheduling.action_kinds import RECV, SEND

LOSS = [Channel(-1, -1, "loss", shape=(2,), dtype="float64")]  # (weighted sum, weights)


class DistributedPipeline(Pipeline):
    """This rank's part of a pipeline (the process group must be initialised).

    Args:
        program: the staged program (the same on every rank); this rank trains its stage
            modules (one per stage it runs) in place, moved to `device`.
        rank: this process's rank.
        device: where this rank computes (`runtime.distributed.init_process_group` returns it).
        schedule, num_microbatches, config, built: as for `LocalPipeline`; `config.timeout`
            bounds every wait (`PipelineTimeoutError`).
        settings: instead of `config`, its fields as keywords (`timeout_s=`: `timeout`).
    """

    def __init__(
        self,
        program: StagedProgram,
        *,
        rank: int,
        device: torch.device,
        schedule: str | PipelineSchedule,
        num_microbatches: int | None = None,
        config: TrainConfig | None = None,
        built: Schedule | None = None,
        **settings: Any,
    ) -> None:
        if "timeout_s" in settings:  # the keyword's name here before TrainConfig
            settings["timeout"] = settings.pop("timeout_s")
        config = TrainConfig.given(config, settings)
        rules, built = executor_schedule(program, schedule, num_microbatches, config, built)
        groups = {a.group for actions in built.actions.values() for a in actions if a.group}
        comm = DistributedComm(rank, sorted(groups), timeout_s=config.timeout, device=device)
        # the losses travel in a group of their own: NCCL matches a pair's messages in order
        self.loss_comm = DistributedComm(rank, [], timeout_s=config.timeout, device=device)
        self.loss_ranks = program.plan.stages[-1].ranks
        self.world = tuple(sorted(built.actions))
        self.stage_of = {r: built.stages_of(r)[0] for r in self.world}
        self.owed_loss: int | None = None  # the step whose loss this rank still sends
        workers = [
            StageWorker(program, stage, program.stages[stage].to(device), comm, config, rules,
                        built.num_microbatches)
            for stage in built.stages_of(rank)
        ]  # fmt: skip
        self.rank, self.device, self.comm = rank, device, comm
        super().__init__(program, workers, rules, built)

    def close(self) -> None:
        """Complete the microbatches in flight, then release both comms' process groups.
        Every rank calls it; the pipeline is unusable afterwards."""
        super().close()
        self.comm.close()
        self.loss_comm.close()

    @property
    def worker(self) -> StageWorker:
        """This rank's worker, when it runs one stage."""
        (only,) = self.ranks[self.rank]
        return only

    def train_step(self, args: Sequence[Any], targets: Any, kwargs: dict | None = None) -> float:
        move = lambda v: v.to(self.device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        args = [move(a) for a in args]
        kwargs = {k: move(v) for k, v in (kwargs or {}).items()}
        for source in self.loss_ranks:  # posted early: the sources never wait for this rank
            if source != self.rank:
                self.loss_comm.expect(source, self._loss_key(self.steps, self.rank), LOSS, 0)
        if self.rank in self.loss_ranks:
            self.owed_loss = self.steps
        return super().train_step(args, move(targets), kwargs)

    def _execute(
        self,
        actions: Mapping[int, Sequence[Action]],
        position: dict[int, int],
        stop: dict[int, int] | None,
    ) -> None:
        mine = actions.get(self.rank, ())
        end = len(mine) if stop is None else stop[self.rank]
        position.setdefault(self.rank, 0)
        peers = _exchanges(actions, self.rank, position, stop)
        runner = self.ranks[self.rank]
        # receives posted ahead, a window of them: a sender's bytes move while this rank
        # computes, and the buffers held stay bounded however many microbatches the step has
        ahead = (a for a in mine[position[self.rank] : end] if a.kind == RECV)
        for a in itertools.islice(ahead, RECEIVES_AHEAD):
            runner.expect(a)
        try:
            while position[self.rank] < end:
                action = mine[position[self.rank]]
                runner.run(action)
                runner.finish(action)
                position[self.rank] += 1
                if action.kind == RECV and action.peer != self.rank:
                    self._received(action, peers[action.peer])
                    if (following := next(ahead, None)) is not None:
                        runner.expect(following)
        except Exception as exc:
            self._abort(mine[position[self.rank] : end], exc)
            raise
        if stop is None:  # the peers post every receive of these actions
            self.comm.flush()
        else:  # a send left pending by an earlier call has its receive in this one, or later
            self.comm.settle(lambda peer, key: peer in peers and key in peers[peer].receives)

    def _received(self, action: Action, peer: _Exchange) -> None:
        """The message of `action` came: its peer had then received every message of this
        rank it receives before sending it, so those sends are complete and their buffers
        free (gloo says a send is complete only to a wait, which returns at once now). A
        message sent in an earlier call (streaming schedules) tells nothing more."""
        sent_at = peer.sends.get(action.key)
        if sent_at is None:
            return
        self.comm.settle(
            lambda to, key: to == action.peer and peer.receives.get(key, sent_at) < sent_at
        )

    def _abort(self, rest: Sequence[Action], exc: Exception) -> None:
        """Send the error's text in place of every message still owed in `rest` (from the
        failed action on; a failed send has already told its peer)."""
        failed = rest[0]
        text = (
            f"rank {self.rank} (stage {failed.stage}) stopped at {failed} in step "
            f"{self.steps - 1}: {type(exc).__name__}: {exc}"
        )
        timeout = isinstance(exc, PipelineTimeoutError)  # peers raise the same class
        workers = self.ranks[self.rank].by_stage
        for a in rest[1:] if failed.kind == SEND else rest:
            if a.kind == SEND and a.microbatch in workers[a.stage].data:
                self.comm.send_error(a.peer, *workers[a.stage].message(a), text, timeout)
        if self.owed_loss is not None:  # nor will this step's loss come
            for peer in self.world:
                if peer != self.rank:
                    key = self._loss_key(self.owed_loss, peer)
                    self.loss_comm.send_error(peer, key, LOSS, 0, text, timeout)
            self.owed_loss = None
        self.comm.linger()
        self.loss_comm.linger()

    def _loss(self, batch: Batch, first: int) -> float:
        """Every last-stage rank sends its (weighted sum, weights) to every other rank."""
        total, weight = self._local_loss(batch, first)
        mine = torch.tensor([total, weight], dtype=torch.float64, device=self.device)
        step = self.steps - 1
        if self.owed_loss is not None:
            for peer in self.world:
                if peer != self.rank:
                    self.loss_comm.send(peer, self._loss_key(step, peer), [mine], LOSS, 0)
            self.owed_loss = None
        parts = [mine] + [
            self.loss_comm.recv(source, self._loss_key(step, self.rank), LOSS, 0)[0]
            for source in self.loss_ranks
            if source != self.rank
        ]
        self.loss_comm.settle(lambda peer, key: key[1] < step)  # received by now
        both = torch.stack(parts).sum(0)
        return float(both[0] / both[1])

    def _loss_key(self, step: int, receiver: int) -> Key:
        """The key of a step's loss from the last stage to `receiver` (each source rank
        sends its own: gloo tells them apart by the sender)."""
        return ("loss", step, self.program.num_stages - 1, self.stage_of[receiver])


class _Exchange(NamedTuple):
    """Where a peer's actions of a call receive each message of this rank and send each of its
    own to it: key -> index."""

    receives: dict[Key, int]
    sends: dict[Key, int]


def _exchanges(
    actions: Mapping[int, Sequence[Action]],
    rank: int,
    position: Mapping[int, int],
    stop: Mapping[int, int] | None,
) -> dict[int, _Exchange]:
    """Per peer `rank` sends to or receives from in the call, its `_Exchange` over its actions
    of the call (from `position`, to `stop` or its end)."""
    mine = actions.get(rank, ())
    start = position.get(rank, 0)
    peers = {a.peer for a in mine[start : len(mine) if stop is None else stop[rank]]
             if a.kind in (RECV, SEND) and a.peer != rank}  # fmt: skip
    out = {}
    for peer in peers:
        acts, start = actions[peer], position.get(peer, 0)
        exchange = out[peer] = _Exchange({}, {})
        for i, a in enumerate(acts[start : len(acts) if stop is None else stop[peer]], start):
            if a.peer == rank and a.kind in (RECV, SEND):
                (exchange.receives if a.kind == RECV else exchange.sends)[a.key] = i
    return out
