"""One rank's stage: runs the actions of a schedule on its stage module.

The worker owns a replica of one stage module, its optimizer and the state of the microbatches
in flight (inputs received, outputs sent, gradients coming back). Under a streaming schedule
(`pipedream`, `2bw`) each microbatch's forward and backward run on its weight version
(`runtime/weight_versions.py`) through the module's parameter slots (`runtime/weight_slots.py`).
A backward runs fused (`B`) or split (`I`, the gradients with respect to the stage's inputs,
which go back at once; later `W`, those with respect to its weights). A stage the plan marks
`recompute` keeps only its inputs or segment boundaries and recomputes (`runtime/recompute.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from pdcompile.core.errors import LossError
from pdcompile.lowering.staged_program import Channel, StagedProgram
from pdcompile.passes.planning.timeline import Event
from pdcompile.runtime.comm import Comm, gradient_channels
from pdcompile.runtime.grad_buckets import GradBuckets
from pdcompile.runtime.loss_check import checked_loss
from pdcompile.runtime.memory_probe import MemoryProbe
from pdcompile.runtime.microbatches import Batch, Microbatch
from pdcompile.runtime.recompute import Recompute, entered
from pdcompile.runtime.split_backward import SplitBackward, backward_inputs, fused_reason
from pdcompile.runtime.train_config import OptimizerFactory, TrainConfig
from pdcompile.runtime.weight_slots import WeightSlots
from pdcompile.runtime.weight_versions import WeightVersions, copy_weights
from pdcompile.scheduling import Action, PipelineSchedule
from pdcompile.scheduling.action_kinds import CHECK, CLIP

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: Any = None
    loss: torch.Tensor | None = None
    grads: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # output name, gradient
    version: int = 0
    split: SplitBackward | None = None  # what a split backward's I kept for its W
    again: Callable[[], tuple[Any, Any]] | None = None  # recomputation: I's forward (recompute.py)


class StageWorker:
    """Executes one rank's actions.

    Args:
        program: the staged program; `module` is this rank's own replica of its stage.
        stage: the stage index.
        module: the stage module this rank trains (a copy per replica).
        comm: the rank's communication.
        config: the training settings: the loss (run on the last stage), the optimizer factory
            (applied to the stage's parameters), the scheduler factory (stepped after every
            update), the largest gradient norm (the schedule's `clip` actions apply it),
            autocast, what a non-finite loss does ("raise" a `LossError`, or "skip": with the
            schedule's `check` actions every rank skips the step), vertical sync (where the
            schedule offers it) and `stash` (False: a streaming schedule's backward recomputes
            on the newest weights, only to show the difference).
        rules: the schedule.
        num_microbatches: microbatches per step (`2bw`'s versions count steps).
    """

    def __init__(
        self,
        program: StagedProgram,
        stage: int,
        module: nn.Module,
        comm: Comm,
        config: TrainConfig,
        rules: PipelineSchedule,
        num_microbatches: int = 1,
    ) -> None:
        self.program, self.stage, self.module, self.comm = program, stage, module, comm
        self.last = stage == program.num_stages - 1
        self.config = config
        self.loss_fn = config.loss_fn
        self.params = dict(module.named_parameters())
        self.slots = WeightSlots(module)  # runs it on a weight version's copies
        self.optimizer = _make_optimizer(config.optimizer, self.params, program, stage)
        # a stage without parameters (a ReLU alone) has nothing to schedule either
        schedules = config.lr_scheduler and not isinstance(self.optimizer, NoParameters)
        self.scheduler = config.lr_scheduler(self.optimizer) if schedules else None
        self.clip_grad_norm = config.clip_grad_norm
        self.autocast = config.autocast
        self.evaluating = False
        self.outputs: dict[int, Any] = {}  # evaluation: the last stage's output per microbatch
        self.norm_squares = torch.zeros(1, dtype=torch.float64)  # of the last global clip
        self.rules = rules
        self.streaming = rules.streaming
        if self.streaming:  # updates in the steady state: one call over the stage's tensors
            prefer_foreach(self.optimizer)
        self.stash = config.stash
        self._channels(program, stage)
        self._tensor_groups(program, stage)
        self.buffers = [b for b in module.buffers() if b.dtype != torch.bool]
        self.versions = WeightVersions(
            self.params, rules, num_microbatches,
            vertical=config.vertical_sync and rules.vertical_sync,
            replicas=[s.replicas for s in program.plan.stages], stage=stage,
        )  # fmt: skip
        self.flight: dict[int, _InFlight] = {}
        self.losses: dict[int, float] = {}
        self.data: dict[int, Microbatch] = {}
        self.timeline: list[Event] | None = None
        self.nonfinite = config.nonfinite
        self.skip = False  # every rank agreed to skip this step's update
        self.skipped = 0  # steps skipped for a non-finite loss
        self.nonfinite_flag = torch.zeros(1)  # of the last `check`
        self.saved_buffers: list[torch.Tensor] = []  # "skip": the buffers before the step
        # a split backward: None until the first I; "" split; else why it runs fused
        self.fused: str | None = None
        self.probe: MemoryProbe | None = None  # measures what the rank holds (memory_probe.py)
        spec = program.plan.stages[stage].recompute
        split = rules.items_per_microbatch == 3
        self.recompute = Recompute(module, spec, stage=stage, split=split) if spec else None
        # the replicas' gradient sum, started from the backward of `trigger` (grad_buckets.py)
        self.buckets: GradBuckets | None = None
        self.trigger = -1

    def _channels(self, program: StagedProgram, stage: int) -> None:
        """The channels into this stage by source stage (`inbound`) and out of it by
        destination stage (`outbound`)."""
        self.inbound: dict[int, list[Channel]] = {
            c.src_stage: [] for c in program.channels_to(stage)
        }
        for c in program.channels_to(stage):
            self.inbound[c.src_stage].append(c)
        self.outbound: dict[int, list[Channel]] = {}
        for c in program.channels_from(stage):
            self.outbound.setdefault(c.dst_stage, []).append(c)

    def _tensor_groups(self, program: StagedProgram, stage: int) -> None:
        """The parameters by how they are reduced: per tie group this stage's names of it
        (`tied`), the others (`untied`, replica-averaged), and those the global norm counts
        (`counted`: a tied tensor's copies count once, on its owner)."""
        self.tied = [[n for n in tie.names if n in self.params] for tie in program.ties]
        tied = {n for names in self.tied for n in names}
        self.untied = [p for n, p in self.params.items() if n not in tied]
        copies = {n for tie in program.ties if tie.owner != stage for n in tie.names}
        self.counted = [p for n, p in self.params.items() if n not in copies]

    def overlap_reduction(self, group: tuple[int, ...], microbatch: int) -> None:
        """Start the replicas' gradient sum in buckets from the backward of `microbatch` (this
        replica's last of each step), overlapped with the rest of it (`runtime/grad_buckets.py`;
        the pipeline decides where it is safe)."""
        self.buckets = GradBuckets(self.untied, self.comm, group, ("replicas", self.stage))
        self.trigger = microbatch

    # -- actions ---------------------------------------------------------------------------

    def run(self, action: Action) -> None:
        """Execute one action of this rank's schedule (recorded in `timeline` when it is a
        list, in seconds of `time.perf_counter`)."""
        if self.timeline is None:
            getattr(self, "_" + action.kind)(action)
        else:
            start = time.perf_counter()
            getattr(self, "_" + action.kind)(action)
            self.timeline.append(Event(
                self.comm.rank, action.kind, self.stage, action.microbatch, start,
                time.perf_counter(), action.peer,
            ))  # fmt: skip
        if self.probe is not None:
            self.probe.sample()

    def message(self, a: Action) -> tuple[tuple, list[Channel], int]:
        """The key, channels and rows of the message a `send` or `recv` moves."""
        src, dst = a.key[2:]
        channels = self.outbound[dst] if src == self.stage else self.inbound[src]
        if a.stream == "grad":  # gradients travel against the channels they belong to
            channels = gradient_channels(channels)
        return a.key, channels, self.data[a.microbatch].rows

    def expect(self, a: Action) -> None:
        """Post the receive of a `recv` action ahead of time."""
        self.comm.expect(a.peer, *self.message(a))

    def _recv(self, a: Action) -> None:
        state = self.flight.setdefault(a.microbatch, _InFlight())
        key, channels, rows = self.message(a)
        values = self.comm.recv(a.peer, key, channels, rows)
        if a.stream == "act":
            for c, value in zip(channels, values, strict=True):
                if c.kind == "tensor" and c.requires_grad:
                    value = value.detach().requires_grad_(True)
                state.inputs[c.name] = value
        else:
            state.grads += [(c.name, grad) for c, grad in zip(channels, values, strict=True)]

    def _send(self, a: Action) -> None:
        state = self.flight[a.microbatch]
        key, channels, rows = self.message(a)
        if a.stream == "act":
            # under autocast, activations travel in the dtype the channel was captured in
            values = [_as_channel(state.outputs[c.name], c) for c in channels]
        else:
            # the inputs' gradients leave: the microbatch needs those inputs no more here
            values = [_grad_of(state.inputs.pop(c.name)) for c in channels]
        self.comm.send(a.peer, key, values, channels, rows)

    def _push(self, a: Action) -> None:
        state = self.flight.setdefault(a.microbatch, _InFlight())
        state.version = self.versions.push(a.microbatch)

    def _pop(self, a: Action) -> None:
        self.data.pop(a.microbatch)
        self.versions.pop(self.flight.pop(a.microbatch).version)

    def _F(self, a: Action) -> None:
        k = a.microbatch
        state = self.flight.setdefault(k, _InFlight())
        mb = self.data[k]
        args, kwargs = (mb.args, mb.kwargs) if self.stage == 0 else ((), state.inputs)
        if self.evaluating:
            with torch.no_grad(), self._autocast():
                out = self.module(*args, **kwargs)
            if self.last:
                self.outputs[k] = out
            state.outputs = out
            return
        loss = None
        if self.recompute is not None:  # keeps its inputs (or boundaries) only
            weights, loss_of = self._weights(state) or {}, lambda o: self._loss(o, mb, k)
            with self._saving(k):
                out, loss, state.again = self.recompute.forward(
                    args, kwargs, lambda: entered(self._autocast(), self.slots.swapped(weights)),
                    loss_of if self.last else None,
                )  # fmt: skip
        else:
            with self._autocast(), self._saving(k):
                out = self._call(state, args, kwargs)
        if self.last:
            if loss is None:
                with self._saving(k):
                    loss = self._loss(out, mb, k)
            self.losses[k] = float(loss.detach())
            if not math.isfinite(self.losses[k]) and self.nonfinite == "raise":
                raise LossError(
                    f"the loss is {self.losses[k]} in step {mb.step}, at stage {self.stage} "
                    f"(rank {self.comm.rank}), microbatch {k}: the batch holds NaN or infinite "
                    "values, or training diverged (lower the learning rate, set clip_grad_norm); "
                    "nonfinite='skip' skips such steps on every rank (1f1b, gpipe)"
                )
            state.loss = loss * mb.weight
            if self.recompute is not None:
                out = None  # not kept: only the loss's graph leads back to the inputs
        state.outputs = out

    def _loss(self, out: Any, mb: Microbatch, k: int) -> torch.Tensor:
        where = f"at stage {self.stage} (rank {self.comm.rank}), microbatch {k} of step {mb.step}"
        return checked_loss(self.loss_fn, out, mb.target, where)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision on the forward (weights and stashed versions stay in their dtype)."""
        if self.autocast is None:
            return contextlib.nullcontext()
        device = next(iter(self.params.values()), torch.empty(0)).device
        return torch.autocast(device.type, dtype=self.autocast)

    def _saving(self, microbatch: int) -> contextlib.AbstractContextManager:
        """With the memory probe on: what autograd saves in the block counts for `microbatch`."""
        if self.probe is None:
            return contextlib.nullcontext()
        return self.probe.saving(self, microbatch)

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Forwards without gradients, leaf modules (BatchNorm, Dropout) in eval mode; the
        outputs of the last stage land in `outputs`. Branches the capture traced through on
        `self.training` keep the captured mode (the graph is fixed to it)."""
        leaves = [m for m in self.module.modules() if m is not self.module]
        modes = [m.training for m in leaves]
        self.evaluating, self.outputs = True, {}
        for m in leaves:
            m.training = False
        try:
            yield
        finally:
            for m, mode in zip(leaves, modes, strict=True):
                m.training = mode
            self.evaluating = False
            self.flight.clear()
            self.data.clear()

    def _weights(self, state: _InFlight) -> dict[str, torch.Tensor] | None:
        """The weight copy a microbatch runs on (None: the live weights)."""
        return self.versions.copies[state.version] if self.streaming else None

    def _call(self, state: _InFlight, args: tuple, kwargs: dict[str, Any]) -> Any:
        weights = self._weights(state)
        if weights is not None:
            return self.slots(weights, args, kwargs)
        return self.module(*args, **kwargs)

    def _B(self, a: Action) -> None:
        k = a.microbatch
        state = self.flight[k]
        weights = self._weights(state)
        if self.streaming and not self.stash:
            # no stashing: the backward sees the newest weights (forward again on them)
            weights = copy_weights(self.params)
            mb = self.data[k]
            args, kwargs = (mb.args, mb.kwargs) if self.stage == 0 else ((), state.inputs)
            state.outputs = self.slots(weights, args, kwargs)
            if self.last:
                state.loss = self.loss_fn(state.outputs, mb.target) * mb.weight
        tensors, grads = self._roots(state)
        armed = self.buckets is not None and k == self.trigger
        if armed:
            self.buckets.arm()
        try:
            if tensors:
                torch.autograd.backward(tensors, grads)
        finally:
            if armed:
                self.buckets.disarm()
        if self.streaming and not self.stash:
            self.versions.collect(weights)  # a copy of its own: its gradients go now
        state.outputs, state.grads, state.loss = None, [], None

    def _I(self, a: Action) -> None:
        """The split backward's first part: the gradients of the stage's inputs (sent back at
        once), keeping for `W` the gradients where the weights' branches join the graph
        (`runtime/split_backward.py`). A stage whose backward cannot be split runs it whole
        here (`fused`), and its `W` has nothing left to do."""
        state = self.flight[a.microbatch]
        if state.again is not None:  # recomputation: the forward again, I and W share it
            with self._saving(a.microbatch):
                state.outputs, loss = state.again()
            state.loss = loss * self.data[a.microbatch].weight if self.last else None
            state.again = None
        tensors, grads = self._roots(state)
        inputs = [
            v for v in state.inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad
        ]
        if self.fused is None:  # decided once per stage, on its first backward
            self.fused = fused_reason(tensors, inputs) or ""
            if self.fused:
                log.info("stage %d runs its backward fused: %s", self.stage, self.fused)
        if self.fused:
            if tensors:
                torch.autograd.backward(tensors, grads)
        elif tensors:
            leaves = list((self._weights(state) or self.params).values())
            found, state.split = backward_inputs(tensors, grads, inputs, leaves)
            for tensor, grad in zip(inputs, found, strict=True):
                tensor.grad = grad
        state.outputs, state.grads, state.loss = None, [], None  # W needs only `split`

    def _FB(self, a: Action) -> None:
        """An overlapped pair opens (`action_kinds.overlapped`): its forward and backward part
        are the next two actions, run one after the other by `_F` and `_B` (or `_I`, `_W`), the
        forward first. That is all a CPU can do; a GPU could launch the forward on a second
        CUDA stream here and join it after the backward, which this runtime does not do yet."""

    def _W(self, a: Action) -> None:
        """The split backward's second part: the gradients of the weights the microbatch ran
        on, from what `I` kept (no part of the backward runs twice)."""
        state = self.flight[a.microbatch]
        if state.split is not None:
            state.split.weights()
        state.split = None

    def _roots(self, state: _InFlight) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Where a microbatch's backward starts: the loss on the last stage, else the outputs
        whose gradients came back (none: nothing to do)."""
        if self.last:
            return [state.loss], [None]
        tensors = [state.outputs[name] for name, _ in state.grads]
        grads = [g.to(t.dtype) for t, (_, g) in zip(tensors, state.grads, strict=True)]
        return tensors, grads

    def _allreduce(self, a: Action) -> None:
        self.versions.collect()
        if a.tie >= 0:
            names = self.tied[a.tie]
            tensors = [ensure_grad(self.params[n]) for n in names[:1]]
        else:
            tensors = [ensure_grad(p) for p in self.untied]
        # replicas updating per microbatch (pipedream) make one shared update from the average
        # of their gradients; the others' microbatch losses are weighted by their share of the
        # step: the sum is the mean
        average = a.tie < 0 and self.rules.update_per_microbatch
        if a.tie < 0 and self.buckets is not None:  # started from the last backward
            self.buckets.finish()
        else:
            self.comm.all_reduce(tensors, a.group, a.collective, average=average)
        if a.tie < 0 and self.buffers:  # buffers are not averaged: the replicas take the first's
            if self.comm.rank != a.group[0]:
                for b in self.buffers:
                    b.zero_()
            self.comm.all_reduce(self.buffers, a.group, (*a.collective, "buffers"))

    def _clip(self, a: Action) -> None:
        """Scale the gradients so that their norm over this stage is at most `clip_grad_norm`
        (a `clip` without a group, `pipedream`; a group's norm is all-reduced by the rank,
        `RankWorkers`, and applied by `finish`)."""
        self._scale(self.clip_squares(a))

    def clip_squares(self, a: Action) -> float:
        """This stage's share of the squared gradient norm of a `clip` (each tensor counted
        once over the group: on first replicas and tie owners)."""
        self.versions.collect()
        if not a.group:
            grads = [p.grad for p in self.params.values() if p.grad is not None]
            return float(sum(g.double().pow(2).sum() for g in grads))
        if self.comm.rank != self.program.plan.stages[self.stage].ranks[0]:
            return 0.0
        counted = [p.grad for p in self.counted if p.grad is not None]
        return float(sum(g.double().pow(2).sum() for g in counted))

    def nonfinite_loss(self) -> bool:
        """Whether a loss this stage computed in the step was NaN or infinite."""
        return any(not math.isfinite(loss) for loss in self.losses.values())

    def tensor_device(self) -> torch.device:
        return getattr(self.comm, "device", torch.device("cpu"))

    def finish(self, a: Action) -> None:
        """Complete a collective once every member has taken part (the local executor runs
        the members one after another; an all-reduce may land only with the last)."""
        if a.kind == CHECK:
            self.skip = bool(self.nonfinite_flag[0] > 0)
        if a.kind == CLIP and a.group and not self.skip:
            self._scale(float(self.norm_squares[0]))

    def _scale(self, squares: float) -> None:
        coefficient = self.clip_grad_norm / (squares**0.5 + 1e-6)
        if coefficient < 1:
            for p in self.params.values():
                if p.grad is not None:
                    p.grad.mul_(coefficient)

    def _step(self, a: Action) -> None:
        self.versions.collect()
        if self.skip:  # a non-finite loss: no update, the buffers as before the step
            self.skip, self.skipped = False, self.skipped + 1
            self.optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for buffer, saved in zip(self.module.buffers(), self.saved_buffers, strict=True):
                    buffer.copy_(saved)
            log.warning("rank %d: step skipped: a loss was not finite", self.comm.rank)
            self.flight.clear()
            self.data.clear()
            return
        self.versions.before_update()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.versions.after_update()
        if not self.streaming:
            self.flight.clear()  # a synchronous step ends with every microbatch done
            self.data.clear()

    # -- per step --------------------------------------------------------------------------

    def add_microbatches(self, batch: Batch, first: int, step: int = 0) -> None:
        """Make a step's microbatches known, numbered from `first` (`step`: the train step)."""
        given = batch.items(first)
        self.data.update({k: dataclasses.replace(m, step=step) for k, m in given.items()})
        self.losses = {}
        if self.nonfinite == "skip" and not self.evaluating:
            self.saved_buffers = [b.detach().clone() for b in self.module.buffers()]


class NoParameters:
    """The optimizer of a stage holding no parameters (a stage of an activation alone, which a
    plan with more stages than weighted layers has): its steps do nothing, and it holds no state,
    as a checkpoint or a move reads it (`param_groups`, `state`, `state_dict`)."""

    param_groups: list[dict[str, Any]] = []
    state: dict[Any, Any] = {}

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _make_optimizer(
    factory: OptimizerFactory, params: dict[str, nn.Parameter], program: StagedProgram, stage: int
) -> torch.optim.Optimizer | NoParameters:
    """The stage's optimizer; `NoParameters` for a stage without parameters (the user's
    optimizers refuse an empty list)."""
    if not params:
        return NoParameters()
    return factory(list(params.values()))


def prefer_foreach(optimizer: torch.optim.Optimizer) -> None:
    """Let `optimizer` update all of a group's tensors in one `foreach` call where its
    factory left the choice to torch (`foreach=None`, which takes the loop over tensors on a
    CPU): the same arithmetic, without a Python round per tensor (`pipedream` steps per
    microbatch)."""
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True


def _as_channel(value: Any, channel: Channel) -> Any:
    """A floating tensor computed in another precision (autocast), cast to its channel's."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and channel.kind == "tensor":
        dtype = getattr(torch, channel.dtype)
        if dtype.is_floating_point and value.dtype != dtype:
            return value.detach().to(dtype)
    return value


def _grad_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)


def ensure_grad(p: nn.Parameter) -> torch.Tensor:
    """`p`'s gradient, zeros where it has none yet."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad
