"""What every executor shares: the schedule, the microbatches, and the streaming schedules'
endless stream.

A synchronous step runs every rank's schedule to its end. Under a streaming schedule
(`pipedream`, `2bw`) microbatches stay in flight across `train_step` calls: the ranks walk one
endless stream of actions (the schedule of a pipeline that never drains, unfolded as it is
walked: `runtime/stream.py`), and each call runs every rank up to its first forward of a
microbatch it has not been given yet; `flush()` completes the rest, and the next call fills the
pipeline again. Subclasses say how a rank's actions run (`_execute`) and how the loss reaches
every rank (`_loss`).
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pdcompile.core.errors import BatchError, ConfigError
from pdcompile.core.ir import accept_constants
from pdcompile.lowering.staged_program import StagedProgram
from pdcompile.passes.planning.validate import validate_schedule
from pdcompile.runtime.microbatches import Batch, input_dims, split_batch
from pdcompile.runtime.rank_workers import RankWorkers
from pdcompile.runtime.stream import RankStream
from pdcompile.runtime.train_config import TrainConfig
from pdcompile.runtime.worker import StageWorker
from pdcompile.scheduling import (
    Action,
    PipelineSchedule,
    Schedule,
    forward_schedule,
    get_schedule,
    replica_orders,
)
from pdcompile.scheduling.action_kinds import needs_microbatch
from pdcompile.scheduling.builder import Layout, build
from pdcompile.scheduling.reduce_overlap import overlap_triggers


def program_edges(program: StagedProgram) -> dict[tuple[int, int], bool]:
    """(source stage, destination stage) -> whether gradients flow back along it."""
    edges: dict[tuple[int, int], bool] = {}
    for c in program.channels:
        pair = (c.src_stage, c.dst_stage)
        edges[pair] = edges.get(pair, False) or (c.kind == "tensor" and c.requires_grad)
    return edges


def program_schedule(
    program: StagedProgram,
    rules: PipelineSchedule,
    num_microbatches: int,
    clip: bool = False,
    skip_nonfinite: bool = False,
    num_steps: int = 1,
) -> Schedule:
    """The validated schedule of `program` under its plan's ranks (`num_steps` steps as one
    stream for a streaming schedule)."""
    ranks = [stage.ranks for stage in program.plan.stages]
    ties = [tie.stages for tie in program.ties]
    layout = Layout(ranks, program_edges(program), num_microbatches, ties, clip, skip_nonfinite)
    schedule = build(rules, layout, num_steps)
    validate_schedule(schedule)
    return schedule


def executor_schedule(
    program: StagedProgram,
    schedule: str | PipelineSchedule,
    num_microbatches: int | None,
    config: TrainConfig,
    built: Schedule | None = None,
) -> tuple[PipelineSchedule, Schedule]:
    """The rules and the schedule an executor walks: `built` as given (`compile` built it once,
    under `config`'s clipping and non-finite check), else built here for `num_microbatches`.

    Raises:
        ConfigError: `config` asks what the schedule cannot do, or no count is given.
    """
    rules = get_schedule(schedule)
    if built is not None:
        return rules, built
    config.check_schedule(rules)
    if num_microbatches is None:
        raise ConfigError(
            "an executor needs num_microbatches= (microbatches per train_step), or built= "
            "(the schedule program_schedule built)"
        )
    clip, skip = config.clip, config.skip_nonfinite
    return rules, program_schedule(program, rules, num_microbatches, clip, skip)


class Pipeline:
    """Runs train steps of a StagedProgram on `workers` (the stage replicas this process
    drives, one per stage of each of its ranks) along `schedule`, built under `rules`.

    `workers[(rank, stage)]` is a worker; `ranks[rank]` runs a rank's actions on its workers.
    """

    def __init__(
        self,
        program: StagedProgram,
        workers: list[StageWorker],
        rules: PipelineSchedule,
        schedule: Schedule,
    ) -> None:
        self.program = program
        self.input_dims = input_dims(program.input_specs)  # read once, split by every step
        self.rules = rules
        self.kind = rules.name
        self.streaming = rules.streaming
        self.num_microbatches = num_microbatches = schedule.num_microbatches
        self.clip = any(w.clip_grad_norm is not None for w in workers)
        self.skip = any(w.nonfinite == "skip" for w in workers)
        self.schedule = schedule
        self.workers = {(w.comm.rank, w.stage): w for w in workers}
        by_rank: dict[int, dict[int, StageWorker]] = {}
        for (rank, stage), worker in self.workers.items():
            by_rank.setdefault(rank, {})[stage] = worker
        self.ranks = {rank: RankWorkers(rank, mine) for rank, mine in sorted(by_rank.items())}
        if not self.streaming:  # replicas reduce their gradients from the last backward on
            for (rank, stage), microbatch in overlap_triggers(self.schedule.actions).items():
                if (rank, stage) in self.workers:
                    group = tuple(program.plan.stages[stage].ranks)
                    self.workers[(rank, stage)].overlap_reduction(group, microbatch)
        self.steps = 0  # train steps run
        self.started = 0  # streaming: microbatches given since the last flush
        # streaming: actions every rank has done since the stream (re)started (each call, every
        # rank runs to its cut, so this process knows where the other ranks are too)
        self.position = dict.fromkeys(self.schedule.actions, 0)
        self.streams: dict[int, RankStream] = {}
        if self.streaming:
            # the stream unfolds with the code that built this schedule, validated over enough
            # steps to reach the steady state that repeats from then on
            lookahead = self.rules.lookahead(self.schedule.replicas, num_microbatches)
            steps = -(-lookahead // num_microbatches) + 1
            program_schedule(program, self.rules, num_microbatches, self.clip, num_steps=steps)
            self._new_stream()
        self._forward: Schedule | None = None  # evaluation
        for worker in workers:
            worker.versions.begin_stream()

    def train_step(self, args: Sequence[Any], targets: Any, kwargs: dict | None = None) -> float:
        """One step over the batch (every rank passes the same batch); returns the loss on every
        rank: the mean over the microbatches whose losses the last stage computed in this call,
        weighted by their rows. Every schedule computes all of this step's losses in the call
        (streaming ones leave backwards in flight), so this is the step's loss."""
        kwargs = accept_constants(self.program.constants, kwargs or {}, self.program.model_name)
        check_batch(self.program, args, kwargs, self._input_device())
        weighted = not self.rules.update_per_microbatch  # else a microbatch is a whole update
        batch = split_batch(args, kwargs or {}, targets, self.num_microbatches, weighted=weighted,
                            dims=self.input_dims)  # fmt: skip
        first = self.started if self.streaming else 0
        for worker in self.workers.values():
            worker.add_microbatches(batch, first, self.steps)
        self.steps += 1
        if self.streaming:
            self.started += self.num_microbatches
            stop = cuts(self.streams, self.started, self.position)
            self._execute(self.streams, self.position, stop)
            self.position.update(stop)
            for rank, stream in self.streams.items():
                stream.release(self.position[rank])
        else:
            actions = self.schedule.actions
            self._execute(actions, dict.fromkeys(self.ranks, 0), None)
        return self._loss(batch, first)

    def eval_step(self, args: Sequence[Any], kwargs: dict | None = None) -> Any:
        """Forward the batch without gradients (after a flush); returns what the model returns
        for the whole batch on the first replica of the last stage, None elsewhere."""
        self.flush()
        kwargs = accept_constants(self.program.constants, kwargs or {}, self.program.model_name)
        check_batch(self.program, args, kwargs, self._input_device())
        batch = split_batch(args, kwargs or {}, None, self.num_microbatches, weighted=False,
                            dims=self.input_dims)  # fmt: skip
        if self._forward is None:
            ranks = [stage.ranks for stage in self.program.plan.stages]
            self._forward = forward_schedule(ranks, program_edges(self.program), batch.size)
            validate_schedule(self._forward)
        with contextlib.ExitStack() as stack:
            for worker in self.workers.values():
                stack.enter_context(worker.evaluation())
                worker.add_microbatches(batch, 0)
            actions = self._forward.actions
            self._execute(actions, dict.fromkeys(actions, 0), None)
            holders = [w for w in self.workers.values() if w.last and w.outputs]
            if not holders:
                return None
            return concat([holders[0].outputs[k] for k in range(self.num_microbatches)])

    def flush(self) -> None:
        """Complete every microbatch in flight (streaming schedules; nothing to do for the
        others)."""
        if not self.streaming or not self.started:
            return
        drain = {r: s.drain(self.position[r], self.started) for r, s in self.streams.items()}
        self._execute(drain, dict.fromkeys(drain, 0), None)
        self.started = 0
        self.position = dict.fromkeys(self.schedule.actions, 0)
        self._new_stream()
        for worker in self.workers.values():
            worker.versions.begin_stream()

    def close(self) -> None:
        """Complete the microbatches in flight and release what the pipeline holds besides its
        workers (the distributed executor's process groups; nothing here)."""
        self.flush()

    def restart(self) -> None:
        """After the weights changed from outside (a checkpoint loaded): weight versions start
        again from the live weights (`2bw`'s previous ones: `WeightVersions.restore_previous`)."""
        self.flush()
        for worker in self.workers.values():
            worker.versions.restart()

    def _execute(
        self,
        actions: Mapping[int, Sequence[Action]],
        position: dict[int, int],
        stop: dict[int, int] | None,
    ) -> None:
        raise NotImplementedError

    def _loss(self, batch: Batch, first: int) -> float:
        raise NotImplementedError

    def _input_device(self) -> torch.device | None:
        """Where stage 0 runs in this process (None: not here)."""
        for worker in self.workers.values():
            if worker.stage == 0:
                tensor = next(iter([*worker.module.parameters(), *worker.module.buffers()]), None)
                return tensor.device if tensor is not None else None
        return None

    def _local_loss(self, batch: Batch, first: int) -> tuple[float, float]:
        """(sum of weight * loss, sum of weights) over the step's microbatches this process's
        last-stage ranks computed."""
        total = weight = 0.0
        for worker in self.workers.values():
            if worker.last:
                for k, loss in worker.losses.items():
                    share = batch.microbatches[k - first].weight
                    total += loss * share
                    weight += share
        return total, weight

    def _new_stream(self) -> None:
        layout = Layout(
            [stage.ranks for stage in self.program.plan.stages], program_edges(self.program),
            self.num_microbatches, [tie.stages for tie in self.program.ties], self.clip,
        )  # fmt: skip
        orders = replica_orders(self.rules, layout)
        self.streams = {rank: RankStream(order) for (rank, _), order in orders.items()}


_SPEC = re.compile(r"^(\w+)\[(.*)\]$")


def check_batch(
    program: StagedProgram, args: Sequence[Any], kwargs: dict[str, Any], device: Any = None
) -> None:
    """Raise `BatchError` unless `args` and `kwargs` are the captured graph's tensor inputs
    (by position or by name) with their dtypes and sizes (any size along batch dimensions), on
    `device` when one is given."""
    names, model = list(program.input_specs), program.model_name
    wanted = f"{model} was captured with the tensor inputs ({', '.join(names)})"
    if len(args) > len(names):
        raise BatchError(f"{len(args)} positional inputs given, but {wanted}")
    given = dict(zip(names, args, strict=False))
    for name in kwargs:
        if name not in names or name in given:
            raise BatchError(f"input {name!r} given twice or unknown: {wanted}")
    given.update(kwargs)
    missing = [n for n in names if n not in given]
    if missing:
        raise BatchError(f"inputs {missing} missing: {wanted}")
    for name, value in given.items():
        spec = program.input_specs[name]
        match = _SPEC.match(spec)
        if match is None:  # not a tensor spec: nothing to compare
            continue
        if not isinstance(value, torch.Tensor):
            kind = type(value)
            what = kind.__qualname__
            what = what if kind.__module__ == "builtins" else f"{kind.__module__}.{what}"
            hint = " (torch.from_numpy converts it)" if kind.__module__ == "numpy" else ""
            raise BatchError(f"input {name!r} is a {what}{hint}; {model} takes a tensor {spec}")
        dtype, dims = match.group(1), [d for d in match.group(2).split(", ") if d]
        shape, got_dtype = list(value.shape), str(value.dtype).removeprefix("torch.")
        fits = got_dtype == dtype and len(dims) == len(shape)
        if not fits or any(d.isdigit() and int(d) != s for d, s in zip(dims, shape, strict=True)):
            raise BatchError(
                f"input {name!r} is {got_dtype}{shape}, but {model} was captured with {spec}: "
                "only sizes marked batch may change; pass batches like the example inputs (or "
                "compile again with example inputs of this shape and dtype)"
            )
        if device is not None and value.device != torch.device(device):
            raise BatchError(
                f"input {name!r} is on {value.device} but stage 0 runs on {device}: move the "
                f"batch there first (.to({str(device)!r}))"
            )


def cuts(streams: Mapping[int, RankStream], bound: int, position: dict[int, int]) -> dict[int, int]:
    """Where each rank stops in its endless stream when minibatches < `bound` are given: at its
    first action that needs a later minibatch, or earlier at an all-reduce some member of its
    group cannot reach before its own stop (a tied tensor's copies update together). Every
    rank has done the actions before `position`."""
    start = position
    stop = {rank: _first_needing(stream, bound, start[rank]) for rank, stream in streams.items()}
    changed = True
    while changed:
        changed = False
        for rank, stream in streams.items():
            for i, a in enumerate(stream[start[rank] : stop[rank]], start[rank]):
                if a.is_collective and not all(
                    _reaches(streams[m], start[m], stop[m], a) for m in a.group
                ):
                    stop[rank], changed = i, True
                    break
    return stop


def _first_needing(stream: RankStream, bound: int, start: int) -> int:
    """The index of the first action from `start` on that needs a minibatch >= `bound` (there
    is one: the stream is endless)."""
    return next(i for i in itertools.count(start) if _needs(stream[i], bound))


def _needs(a: Action, bound: int) -> bool:
    return needs_microbatch(a.kind, a.stream) and a.microbatch >= bound


def _reaches(stream: RankStream, start: int, stop: int, collective: Action) -> bool:
    return any(
        a.is_collective and a.collective == collective.collective for a in stream[start:stop]
    )


def concat(parts: list[Any]) -> Any:
    """Microbatch outputs joined along dim 0, keeping their structure (tuples, dicts, model
    output classes); values that are not tensors come from the first microbatch."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else first
    if isinstance(first, (tuple, list)) and not hasattr(first, "_fields"):
        return type(first)(concat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        joined = {k: concat([p[k] for p in parts]) for k in first}
        return joined if type(first) is dict else type(first)(**joined)
    return first
