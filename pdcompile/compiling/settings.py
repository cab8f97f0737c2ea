"""`compile`'s keywords as three checked configs: `CaptureConfig` (the example call and how it
is captured), `PlanConfig` and `TrainConfig`, and what they must agree on together."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdcompile.core.errors import ConfigError, PlanConfigError
from pdcompile.passes.planning.plan_config import PlanConfig
from pdcompile.runtime.train_config import TrainConfig

# config fields that are not `compile` keywords (`plan()`'s and the executors' own)
NOT_COMPILE = ("microbatch_size", "replica_counts", "chunks", "solver_options", "stash")


@dataclass(frozen=True)
class CaptureConfig:
    """The example call and how the model is captured: `compile`'s keywords of these names
    (`trace` checks them against the model).

    Attributes:
        example_inputs: one example call's positional inputs (a microbatch or a batch).
        example_kwargs: its keyword inputs.
        example_targets: the targets of the example's rows, as `train_step` gets them: with
            them the profile prices `loss_fn` on the last stage (`analyze(loss_fn=,
            targets=)`); None: the loss is left out of the plan, which `explain()` says.
        leaf_modules: modules the capture keeps whole (classes or qualified names).
        batch_dims: inputs whose batch is not along dim 0, by name: the dimension holding it,
            or None for an input every microbatch gets whole (`trace(batch_dims=)`).
    """

    example_inputs: tuple[Any, ...]
    example_kwargs: dict[str, Any] | None = None
    example_targets: Any = None
    leaf_modules: Sequence[Any] = ()
    batch_dims: dict[str, int | None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.example_inputs, Sequence) or isinstance(self.example_inputs, str):
            raise ConfigError(
                f"example_inputs must be a tuple of the example call's positional inputs, got "
                f"{type(self.example_inputs).__name__}; pass e.g. (x,)"
            )
        object.__setattr__(self, "example_inputs", tuple(self.example_inputs))
        if self.example_kwargs is not None and not isinstance(self.example_kwargs, dict):
            raise ConfigError(
                f"example_kwargs must be a dict of the example call's keyword inputs or None, "
                f"got {type(self.example_kwargs).__name__}"
            )


@dataclass(frozen=True)
class Settings:
    """Everything a `compile` call was given, checked."""

    capture: CaptureConfig
    plan: PlanConfig
    train: TrainConfig


CONFIGS = {"capture": CaptureConfig, "plan": PlanConfig, "train": TrainConfig}
KEYWORDS = {  # compile keyword -> the config holding it
    f.name: part
    for part, config in CONFIGS.items()
    for f in dataclasses.fields(config)
    if f.name not in (*NOT_COMPILE, "example_inputs")
}


def compile_settings(example_inputs: Sequence[Any], keywords: dict[str, Any]) -> Settings:
    """`compile(model, example_inputs, **keywords)`'s settings (on every rank, before joining,
    so that all raise the same error).

    Raises:
        ConfigError: an unknown or missing keyword, a bad value (the configs' checks), or
            settings that contradict each other.
    """
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], KEYWORDS, n=1)
        raise ConfigError(
            f"compile got unknown keywords {unknown}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; it takes {sorted(KEYWORDS)}"
        )
    missing = [k for k in ("loss_fn", "optimizer") if k not in keywords]
    if missing:
        raise ConfigError(
            f"compile needs {' and '.join(f'{k}=' for k in missing)}: loss_fn(output, target) "
            "-> scalar and optimizer, a factory params -> torch.optim.Optimizer"
        )
    parts: dict[str, dict[str, Any]] = {part: {} for part in CONFIGS}
    for name, value in keywords.items():
        parts[KEYWORDS[name]][name] = value
    train = TrainConfig(**parts["train"])  # first: a bad optimizer is named before the plan's
    plan = PlanConfig(**parts["plan"])
    capture = CaptureConfig(example_inputs, **parts["capture"])
    if train.replan is not None and plan.plan is not None and plan.costs is None:
        raise PlanConfigError(
            "replan needs the costs the plan was made from to rescale them: pass costs= (the "
            "CostGraph or its JSON file) with plan=, or leave plan= out"
        )
    if not plan.auto:  # else once the plan says which schedule runs
        train.check_schedule(plan.rules)
    return Settings(capture, plan, train)
