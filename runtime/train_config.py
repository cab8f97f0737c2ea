"""`TrainConfig`: how the stages train (loss, optimizer, scheduler, clipping, precision,
non-finite losses, vertical sync, timeouts, checkpoints, the memory probe, re-planning), checked
once, when it is built; executors and workers read it."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from pdcompile.core.errors import (
    CheckpointConfigError,
    ConfigError,
    CostConfigError,
    PdcompileError,
    PlanConfigError,
    ScheduleConfigError,
)
from pdcompile.passes.planning.replan_decision import Replan
from pdcompile.scheduling import PipelineSchedule

LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
Weights = Callable[[], dict[str, torch.Tensor]] | str | None
NONFINITE = ("raise", "skip")  # what a step with a NaN or infinite loss does


@dataclass(frozen=True)
class TrainConfig:
    """The training settings: `compile`'s keywords of the same names, which the executors
    and workers read (they take them as keywords too).

    Attributes:
        loss_fn: `loss_fn(output, target) -> scalar`, run on the last stage.
        optimizer: a factory `params -> torch.optim.Optimizer`, applied to each stage replica
            (built and stepped once on one tensor here); the profile times its step per node
            and sizes its state.
        lr_scheduler: a factory `optimizer -> LRScheduler`, stepped after every update.
        clip_grad_norm: the largest gradient norm (global; per stage under `pipedream`, where
            stages sharing tied weights clip together).
        autocast: a dtype for `torch.autocast` around every forward (weights stay fp32).
        nonfinite: what a NaN or infinite loss does: "raise" a `LossError` naming the step,
            stage and microbatch, or "skip" the step on every rank (no update, no scheduler
            step; synchronous schedules only; `skipped_steps` counts them).
        vertical_sync: under `pipedream`, minibatch k runs at every stage on weights that
            include only the minibatches stage 0's weights for k include (docs/runtime.md).
        stash: an executor's, not `compile`'s: False runs a streaming schedule's backward on
            the newest weights (no weight stashing), only to show what stashing prevents.
        timeout: seconds any wait of a training step may last (a checkpoint's too).
        startup_timeout: seconds the start-up (capture, planning, broadcast) may last.
        checkpoint_dir: a folder every rank sees: on start every rank loads the newest valid
            checkpoint in it (`PipelinedModule.resume`; `steps` goes on from its step count),
            and every `checkpoint_every` steps the job saves `step-<steps>` there, keeping the
            newest 3 (docs/checkpoints.md). One rank per stage (torchrun).
        checkpoint_every: train steps between automatic checkpoints (with `checkpoint_dir`).
        measure_memory: measure what each rank holds (`PipelinedModule.measure_memory`:
            parameters, gradients, optimizer state, weight versions, saved activations), which
            `explain()` compares with the plan's `rank_memory`.
        replan: the closed loop (a `Replan`, or None; True is read as `Replan()`): after
            `Replan.after_steps` steps the stages' measured times rescale the costs, rank 0
            plans again, and when the new plan is predicted at least `Replan.threshold`
            faster, every rank moves to it (a checkpoint of the running plan, then the new
            stages load it by name; `explain()` shows both plans and the measured step before
            and after). Needs the costs the plan was made from (profiled, or `costs=`).
        weights: for a model on the meta device: a function returning its state dict, or a
            checkpoint directory; each rank materialises only its own stage's tensors.

    Raises:
        ConfigError: any field out of range, naming it, the value and the remedy (of the class
            the phase that checked it before raised too: `CostError` for the optimizer,
            `ScheduleError` for clipping, timeouts and `nonfinite`, `CheckpointError` for
            checkpoints, `PartitionError` for `replan`).
    """

    loss_fn: LossFn
    optimizer: OptimizerFactory
    lr_scheduler: SchedulerFactory | None = None
    clip_grad_norm: float | None = None
    autocast: torch.dtype | None = None
    nonfinite: str = "raise"
    vertical_sync: bool = False
    stash: bool = True
    timeout: float = 300.0
    startup_timeout: float = 900.0
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    measure_memory: bool = False
    replan: Replan | None = None
    weights: Weights = None

    def __post_init__(self) -> None:
        for name, check in _CHECKS.items():
            object.__setattr__(self, name, check(getattr(self, name)))
        _check_checkpoints(self.checkpoint_dir, self.checkpoint_every)

    @classmethod
    def given(cls, config: TrainConfig | None, settings: Mapping[str, Any]) -> TrainConfig:
        """`config`, or (None) the config `settings` spell: an executor's keywords."""
        if config is None:
            return cls(**settings)
        if settings:
            raise ConfigError(
                f"give the training settings either as config= or as keywords, not both: got "
                f"config= and {sorted(settings)}"
            )
        return config

    @property
    def clip(self) -> bool:
        """Whether every update clips the gradients' norm."""
        return self.clip_grad_norm is not None

    @property
    def skip_nonfinite(self) -> bool:
        """Whether a step with a non-finite loss is skipped on every rank."""
        return self.nonfinite == "skip"

    def check_schedule(self, rules: PipelineSchedule) -> None:
        """Raise `ConfigError` (a `ScheduleError` too) unless `rules` can honour `nonfinite`."""
        if self.skip_nonfinite and not rules.synchronous:
            raise ScheduleConfigError(
                f"nonfinite='skip' needs a synchronous schedule (one update per step): under "
                f"{rules.name} updates of different minibatches overlap, so one step cannot be "
                "skipped on every stage; use nonfinite='raise' or schedule='1f1b'"
            )

    def replace(self, **changes: Any) -> TrainConfig:
        """This config with `changes` (checked)."""
        return dataclasses.replace(self, **changes)


def _positive(value: Any) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def _callable(name: str, what: str, optional: bool = True) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if (value is None and optional) or callable(value):
            return value
        raise ConfigError(f"{name} must be {what}, got {type(value).__name__} {value!r}")

    return check


def _optimizer(value: Any) -> OptimizerFactory:
    from pdcompile.passes.step_costs import describe_optimizer

    if isinstance(value, torch.optim.Optimizer) or not callable(value):
        raise CostConfigError(
            f"optimizer must be a factory params -> torch.optim.Optimizer, which compile "
            f"applies to each stage's parameters, got {type(value).__name__}; pass e.g. "
            "lambda params: torch.optim.SGD(params, lr=0.1)"
        )
    try:  # a factory that fails on one tensor raises here, wrapped
        describe_optimizer(value)
    except PdcompileError as exc:
        raise CostConfigError(f"optimizer: {exc}") from None
    return value


def _clip(value: Any) -> float | None:
    if value is not None and not _positive(value):
        raise ScheduleConfigError(
            f"clip_grad_norm must be a finite number > 0 (the largest gradient norm an update "
            f"applies) or None (no clipping), got {value!r}"
        )
    return value


def _autocast(value: Any) -> torch.dtype | None:
    if value is not None and not isinstance(value, torch.dtype):
        raise ConfigError(
            f"autocast must be a torch.dtype (e.g. torch.bfloat16) or None (full precision), "
            f"got {value!r}"
        )
    return value


def _nonfinite(value: Any) -> str:
    if value not in NONFINITE:
        raise ScheduleConfigError(f"nonfinite must be one of {NONFINITE}, got {value!r}")
    return value


def _flag(name: str) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r}")
        return value

    return check


def _seconds(name: str, default: float) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if not _positive(value):
            raise ScheduleConfigError(
                f"{name} must be a finite number of seconds > 0, got {value!r}; the default is "
                f"{default:g} s"
            )
        return value

    return check


def _directory(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike):
        raise CheckpointConfigError(
            f"checkpoint_dir={value!r} is a {type(value).__name__}, not a path: give a folder "
            "every rank sees, e.g. checkpoint_dir='checkpoints'"
        )
    path = os.fsdecode(value)
    if not path.strip():
        raise CheckpointConfigError(
            f"checkpoint_dir={path!r} names no folder: automatic checkpoints would write and "
            "prune step-* folders in the current directory; give a folder every rank sees, "
            "e.g. checkpoint_dir='checkpoints'"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointConfigError(
            f"checkpoint_dir={path!r} is a file: give a folder every rank sees (created if needed)"
        )
    return path


def _every(value: Any) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise CheckpointConfigError(
            f"checkpoint_every={value!r}: give the number of train steps between checkpoints, "
            "an integer >= 1"
        )
    return value


def _check_checkpoints(directory: str | None, every: int | None) -> None:
    """Automatic checkpoints need both settings or neither."""
    if (directory is None) != (every is None):
        given, missing = ("checkpoint_dir", "checkpoint_every")[:: 1 if every is None else -1]
        raise CheckpointConfigError(
            f"{given} was given without {missing}: automatic checkpoints need both (a folder "
            "every rank sees, and the train steps between checkpoints)"
        )


def _replan(value: Any) -> Replan | None:
    policy = Replan() if value is True else value or None
    if policy is not None and not isinstance(policy, Replan):
        raise PlanConfigError(f"replan must be True, False or a pdcompile.Replan, got {value!r}")
    return policy


def _weights(value: Any) -> Weights:
    if value is None or callable(value) or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise ConfigError(
        f"weights must be a function returning the model's state dict, a checkpoint directory "
        f"or None, got {type(value).__name__}"
    )


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "loss_fn": _callable("loss_fn", "a function (output, target) -> scalar loss", False),
    "optimizer": _optimizer,
    "lr_scheduler": _callable("lr_scheduler", "a factory optimizer -> LRScheduler, or None"),
    "clip_grad_norm": _clip,
    "autocast": _autocast,
    "nonfinite": _nonfinite,
    "vertical_sync": _flag("vertical_sync"),
    "stash": _flag("stash"),
    "timeout": _seconds("timeout", 300),
    "startup_timeout": _seconds("startup_timeout", 900),
    "checkpoint_dir": _directory,
    "checkpoint_every": _every,
    "measure_memory": _flag("measure_memory"),
    "replan": _replan,
    "weights": _weights,
}
