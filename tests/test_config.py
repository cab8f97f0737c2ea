"""Settings as objects: `compile`'s keywords become frozen configs (`CaptureConfig`,
`PlanConfig`, `TrainConfig`), each field checked once when its config is built; every bad setting
is a `ConfigError` naming the option and the way out, raised before any work; and one local
`compile` reads its settings once (the schedule built twice: the plan's simulation and the
run's; the schedule looked up by name twice; the cluster read once)."""

from __future__ import annotations

import collections
import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pipeline_support import OPTIMIZERS, accumulate_reference, mlp_case, program_for

import pdcompile
from pdcompile import Cluster, ConfigError, PartitionError
from pdcompile.compiling.settings import KEYWORDS, CaptureConfig, compile_settings
from pdcompile.passes.planning.plan_config import PlanConfig
from pdcompile.runtime.local import LocalPipeline
from pdcompile.runtime.train_config import TrainConfig
from pdcompile.scheduling import builder, registry

SGD = OPTIMIZERS["sgd"]
REQUIRED = {"loss_fn": F.mse_loss, "optimizer": SGD}

BAD = {  # keyword -> (value, words naming the option and the way out)
    "cluster": ("2x", "cluster='2x': cannot read cluster '2x': each level is COUNT"),
    "schedule": ("zz", "unknown schedule 'zz'; registered: 1f1b"),
    "solver": ("nope", "unknown solver 'nope'"),
    "num_microbatches": (0, "num_microbatches must be an integer >= 1, got int 0"),
    "global_batch_size": (2.5, "global_batch_size must be an integer >= 1 (rows per"),
    "memory": ("garbage", "cannot read memory 'garbage'"),
    "recompute": ("yes", "recompute must be None (the planner decides), True"),
    "allow_async": ("yes", "allow_async must be True or False (whether schedule='auto'"),
    "profile": (1, "profile must be True or False (False: analytic costs)"),
    "costs": (3, "costs must be a CostGraph, the path of its JSON file, or None"),
    "plan": (3, "plan must be a Plan, the path of its JSON file, or None"),
    "loss_fn": (None, "loss_fn must be a function (output, target) -> scalar loss"),
    "optimizer": ("instance", "optimizer must be a factory params -> torch.optim.Optimizer"),
    "lr_scheduler": (0.1, "lr_scheduler must be a factory optimizer -> LRScheduler, or None"),
    "clip_grad_norm": (-1.0, "clip_grad_norm must be a finite number > 0"),
    "autocast": ("bf16", "autocast must be a torch.dtype (e.g. torch.bfloat16) or None"),
    "nonfinite": ("ignore", "nonfinite must be one of ('raise', 'skip')"),
    "vertical_sync": ("yes", "vertical_sync must be True or False"),
    "timeout": (-1, "timeout must be a finite number of seconds > 0, got -1; the default"),
    "startup_timeout": (math.inf, "startup_timeout must be a finite number of seconds > 0"),
    "checkpoint_every": (0, "checkpoint_every=0: give the number of train steps between"),
    "measure_memory": ("yes", "measure_memory must be True or False"),
    "replan": ("yes", "replan must be True, False or a pdcompile.Replan"),
    "weights": (3, "weights must be a function returning the model's state dict, a checkpoint"),
    "example_kwargs": ([1], "example_kwargs must be a dict of the example call's keyword"),
}


def test_every_compile_keyword_has_a_bad_value_here() -> None:
    assert set(BAD) | {"example_targets", "leaf_modules", "batch_dims", "checkpoint_dir"} == set(
        KEYWORDS
    )


@pytest.mark.parametrize("keyword", list(BAD))
def test_each_bad_setting_is_a_config_error_naming_the_option_and_the_remedy(keyword) -> None:
    model, x, _, _ = mlp_case()
    value, words = BAD[keyword]
    if value == "instance":
        value = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {"checkpoint_dir": "checkpoints"} if keyword == "checkpoint_every" else {}
    with pytest.raises(ConfigError) as caught:  # before capture: a model that would not trace
        pdcompile.compile(_Untraceable(), (x,), **{**REQUIRED, **extra, keyword: value})
    assert words in str(caught.value)
    assert isinstance(caught.value, ValueError) and isinstance(
        caught.value, pdcompile.PdcompileError
    )


class _Untraceable(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("compile captured the model before checking its settings")


def test_unknown_and_missing_keywords_are_config_errors() -> None:
    _, x, _, _ = mlp_case()
    with pytest.raises(ConfigError, match=r"unknown keywords \['schedul'\] \(did you mean "
                       r"'schedule'\?\); it takes \["):  # fmt: skip
        pdcompile.compile(_Untraceable(), (x,), schedul="1f1b", **REQUIRED)
    with pytest.raises(ConfigError, match="compile needs loss_fn= and optimizer="):
        pdcompile.compile(_Untraceable(), (x,))
    with pytest.raises(ConfigError, match="stash"):  # an executor's setting, not compile's
        pdcompile.compile(_Untraceable(), (x,), stash=False, **REQUIRED)


def test_settings_that_contradict_each_other_are_config_errors(tmp_path) -> None:
    _, x, _, _ = mlp_case()
    cases = [
        ({"schedule": "pipedream", "nonfinite": "skip"}, "nonfinite='skip' needs a synchronous"),
        ({"plan": "plan.json", "replan": True}, "replan needs the costs the plan was made from"),
        ({"checkpoint_dir": str(tmp_path)}, "checkpoint_dir was given without checkpoint_every"),
    ]
    for settings, words in cases:
        with pytest.raises(ConfigError, match=words):
            pdcompile.compile(_Untraceable(), (x,), **REQUIRED, **settings)


def test_a_config_error_is_also_of_the_class_its_phase_raised_before() -> None:
    errors = pdcompile.core.errors
    expected = {  # keyword -> the class an `except` written before configs catches
        "num_microbatches": errors.PartitionError, "memory": errors.PartitionError,
        "clip_grad_norm": errors.ScheduleError, "timeout": errors.ScheduleError,
        "optimizer": errors.CostError, "checkpoint_every": errors.CheckpointError,
    }  # fmt: skip
    for keyword, kind in expected.items():
        value = BAD[keyword][0] if keyword != "optimizer" else 3
        extra = {"checkpoint_dir": "checkpoints"} if keyword == "checkpoint_every" else {}
        with pytest.raises(kind) as caught:
            compile_settings((torch.zeros(1),), {**REQUIRED, **extra, keyword: value})
        assert isinstance(caught.value, ConfigError), keyword


def test_plan_refuses_bad_settings_as_config_errors_too() -> None:
    costs = _costs()
    bad = [
        ({"solver": "nope"}, "unknown solver"),
        ({"chunks": 0}, "chunks must be an integer >= 1"),
        ({"replica_counts": ()}, "replica_counts must be a non-empty"),
    ]
    for options, words in bad:
        with pytest.raises(ConfigError, match=words) as caught:
            pdcompile.plan(costs, 2, **options)
        assert isinstance(caught.value, PartitionError)
    with pytest.raises(ConfigError, match="either as config= or as keywords"):
        pdcompile.plan(costs, config=PlanConfig(cluster=2), solver="uniform")
    with pytest.raises(ConfigError, match="cluster='auto' is measured by a running job"):
        pdcompile.plan(costs, "auto")


def test_plan_with_a_config_is_plan_with_its_keywords() -> None:
    costs = _costs()
    config = PlanConfig(cluster=Cluster.parse("2"), solver="uniform", num_microbatches=4)
    by_config = pdcompile.plan(costs, config=config)
    by_keywords = pdcompile.plan(costs, "2", solver="uniform", num_microbatches=4)
    assert by_config.to_dict() | {"solve_time_s": 0} == by_keywords.to_dict() | {"solve_time_s": 0}


def _costs() -> pdcompile.CostGraph:
    model, x, _, _ = mlp_case()
    return pdcompile.analyze(pdcompile.trace(model, (x,)), (x,), profile=False)


@pytest.mark.parametrize(
    "config",
    [
        PlanConfig(cluster=2),
        TrainConfig(loss_fn=F.mse_loss, optimizer=SGD),
        CaptureConfig((torch.zeros(1),)),
    ],
    ids=["PlanConfig", "TrainConfig", "CaptureConfig"],
)
def test_the_configs_are_frozen(config: Any) -> None:
    name = dataclasses.fields(config)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, name, None)


def test_configs_read_their_values_once_and_check_every_replacement() -> None:
    config = PlanConfig(cluster="2@10GB/s", schedule="gpipe")
    assert config.cluster == Cluster.parse("2@10GB/s") and config.rules.name == "gpipe"
    assert config.replace(num_microbatches=4).rules is config.rules  # not looked up again
    with pytest.raises(ConfigError, match="num_microbatches must be an integer >= 1"):
        config.replace(num_microbatches=0)
    train = TrainConfig(loss_fn=F.mse_loss, optimizer=SGD, replan=True, checkpoint_dir=None)
    assert train.replan == pdcompile.Replan() and not train.clip and not train.skip_nonfinite
    with pytest.raises(ConfigError, match="clip_grad_norm must be"):
        train.replace(clip_grad_norm=0)


def test_an_executor_takes_a_config_or_its_fields_as_keywords() -> None:
    model, x, y, loss_fn = mlp_case()
    program = program_for(model, x, [1, 1])
    config = TrainConfig(loss_fn=loss_fn, optimizer=SGD, clip_grad_norm=1.0)
    by_config = LocalPipeline(program, schedule="1f1b", num_microbatches=2, config=config)
    by_keywords = LocalPipeline(program, schedule="1f1b", num_microbatches=2, loss_fn=loss_fn,
                                optimizer=SGD, clip_grad_norm=1.0)  # fmt: skip
    assert [by_config.train_step((x,), y) for _ in range(2)] == [
        by_keywords.train_step((x,), y) for _ in range(2)
    ]
    with pytest.raises(ConfigError, match="either as config= or as keywords"):
        LocalPipeline(program, schedule="1f1b", num_microbatches=2, config=config, stash=False)
    with pytest.raises(ConfigError, match="nonfinite='skip' needs a synchronous schedule"):
        LocalPipeline(program, schedule="pipedream", num_microbatches=2, loss_fn=loss_fn,
                      optimizer=SGD, nonfinite="skip")  # fmt: skip


def _counted(monkeypatch: pytest.MonkeyPatch, function: Callable, counts: dict) -> None:
    """Count the calls of `function` wherever a module holds it (its own module's name too)."""
    name = function.__name__

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        if args and isinstance(args[0], str):  # a look-up by name
            counts[f"{name} by name"] += 1
        return function(*args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, name, None) is function:
            monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("solver", ["uniform", "dynprog"])
def test_one_local_compile_builds_its_schedule_twice_and_reads_its_settings_once(
    monkeypatch: pytest.MonkeyPatch, solver: str
) -> None:
    model, x, y, loss_fn = mlp_case()
    options = dict(loss_fn=loss_fn, optimizer=SGD, cluster="4", solver=solver, profile=False)
    pdcompile.compile(model, (x,), **options)  # every module the call imports, imported
    counts: collections.Counter[str] = collections.Counter()
    _counted(monkeypatch, builder.build, counts)  # what build_schedule, simulator, runtime call
    _counted(monkeypatch, registry.get_schedule, counts)
    coerce = Cluster.coerce.__func__

    def counted_coerce(cls: type[Cluster], *args: Any, **kwargs: Any) -> Cluster:
        counts["Cluster.coerce"] += 1
        return coerce(cls, *args, **kwargs)

    monkeypatch.setattr(Cluster, "coerce", classmethod(counted_coerce))
    pipe = pdcompile.compile(model, (x,), **options)
    # builds: the plan's simulation and the run's schedule; look-ups: the settings', the
    # executor's (of the object) and, for a one-stage plan, its comparison with `blocks`
    assert counts["build"] == 2, counts
    assert counts["get_schedule"] <= 3 and counts["get_schedule by name"] <= 2, counts
    assert counts["Cluster.coerce"] == 1, counts
    ref, ref_loss = accumulate_reference(model, x, y, loss_fn, SGD,
                                         pipe.pipeline.num_microbatches, 1)  # fmt: skip
    assert pipe.train_step(x, y) == pytest.approx(ref_loss, rel=1e-5)
