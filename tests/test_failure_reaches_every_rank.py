"""Every failure reaches every rank (issue 30, item 5).

Multi-process tier: on 2 and on 3 spawned gloo ranks, one rank fails `compile` after the plan is
shared (in codegen, building its executor after the executor's process groups exist, checking
the layout, resuming, attaching the memory probe) and every other rank raises a
`PdcompileError` of the same class naming that rank and its message, within seconds, while the
failing rank raises its own error; every case runs in turn in one spawned group. A loss function
failing on the last stage only reaches the other ranks as a `StageCommError` naming the rank. A
rank dying before the plan is broadcast is named in rank 0's error.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawn import run_ranks

import pdcompile
from pdcompile import Cluster, Plan, zoo
from pdcompile.core.errors import CodegenError, PartitionError, ScheduleError

TIMEOUT_S = 30  # compile's timeouts in the children: every error must come well before them
FAST_S = 15  # how long a relayed failure may take on a loaded machine


class Injected(Exception):
    """Not a pdcompile error: the others raise plain `PdcompileError` naming it."""


def case(
    world_size: int, stacked: bool = False
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, Plan]:
    """The MLP, and a plan of one stage per rank (the same on every rank); `stacked`: one
    stage more, rank 0 running the first two."""
    torch.manual_seed(0)
    model = zoo.MLP(p=0.0).train()
    x, y = torch.randn(12, 32), torch.randint(0, 10, (12,))
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False)
    num_stages = world_size + stacked
    plan = pdcompile.plan(costs, Cluster.parse(str(num_stages)), solver="uniform",
                          replica_counts=[1])  # fmt: skip
    assert plan.num_stages == num_stages, plan
    stages = tuple(dataclasses.replace(s, ranks=(max(0, s.index - stacked),)) for s in plan.stages)
    return model, x, y, Plan(stages=stages, cluster=Cluster.parse(str(world_size)))


def inject(phase: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this rank fail `phase` of `compile` (the others run it as usual)."""
    import pdcompile.lowering.stage_codegen as stage_codegen
    import pdcompile.passes.planning.validate as validate
    import pdcompile.runtime.executor as executor
    from pdcompile.compiling.pipelined_module import PipelinedModule

    def fail(error: Exception):  # noqa: ANN202
        def raising(*args: object, **kwargs: object) -> None:
            raise error

        return raising

    if phase == "codegen":
        monkeypatch.setattr(stage_codegen, "codegen", fail(CodegenError("no stage for node x")))
    elif phase == "check_layout":  # compile's check against the job (Plan.from_json's passes)
        checked = validate.check_layout

        def check_layout(plan: Plan, num_ranks: int, world: bool = False) -> None:
            if world:
                raise ScheduleError("ranks [9] missing")
            checked(plan, num_ranks)

        monkeypatch.setattr(validate, "check_layout", check_layout)
    elif phase == "executor":  # after DistributedComm made its process groups on every rank
        monkeypatch.setattr(executor, "StageWorker", fail(Injected("optimizer exploded")))
    elif phase == "resume":  # after resume's own collectives
        resume = PipelinedModule.resume

        def resumed(module: PipelinedModule) -> None:
            resume(module)
            raise PartitionError("bad checkpoint")

        monkeypatch.setattr(PipelinedModule, "resume", resumed)
    elif phase == "stacked":  # nothing to inject: this rank runs two stages, so cannot resume
        pass
    elif phase == "measure_memory":
        monkeypatch.setattr(PipelinedModule, "measure_memory", fail(Injected("no probe")))
    else:
        raise AssertionError(phase)


def _compile_failing(rank: int, world_size: int, init_file: str, cases: list) -> list:
    """Each (phase, failing rank) in turn: compile with that rank failing the phase; returns
    (error class, message, seconds) per case on this rank."""
    from pdcompile.runtime.distributed import init_process_group

    init_process_group(rank, world_size, init_file=init_file, timeout_s=TIMEOUT_S)
    model, x, y, plan = case(world_size)
    outcomes = []
    for phase, failing in cases:
        with pytest.MonkeyPatch.context() as monkeypatch:
            if rank == failing:
                inject(phase, monkeypatch)
            resume = {"checkpoint_dir": init_file + ".ckpt", "checkpoint_every": 100}
            extra = resume if phase in ("resume", "stacked") else {}
            if phase == "stacked":
                extra["plan"] = case(world_size, stacked=True)[3]
            start = time.monotonic()
            try:
                pdcompile.compile(model, (x,), loss_fn=F.cross_entropy,
                                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                  measure_memory=phase == "measure_memory", timeout=TIMEOUT_S,
                                  startup_timeout=TIMEOUT_S, **{"plan": plan, **extra})  # fmt: skip
                outcomes.append(("none", "", time.monotonic() - start))
            except Exception as exc:
                outcomes.append((type(exc).__name__, str(exc), time.monotonic() - start))
    dist.destroy_process_group()
    return outcomes


OWN = {  # phase -> (the failing rank's error class, its message)
    "codegen": ("CodegenError", "no stage for node x"),
    "check_layout": ("ScheduleError", "ranks [9] missing"),
    "executor": ("Injected", "optimizer exploded"),
    "resume": ("PartitionError", "bad checkpoint"),
    "stacked": ("CheckpointError", "compile(checkpoint_dir=...) checkpoints one stage per"),
    "measure_memory": ("Injected", "no probe"),
}
RELAYED = {"Injected": "PdcompileError"}  # not a pdcompile error: the base class


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_failing_after_the_plan_is_shared_stops_every_rank_by_name(
    world_size: int,
) -> None:
    last = world_size - 1
    cases = [("codegen", last), ("executor", 0), ("check_layout", 1), ("resume", last),
             ("stacked", 0), ("measure_memory", 1), ("codegen", 0)]  # fmt: skip
    per_rank = run_ranks(_compile_failing, world_size, cases, timeout_s=240)
    for i, (phase, failing) in enumerate(cases):
        kind, text = OWN[phase]
        for rank in range(world_size):
            error, message, seconds = per_rank[rank][i]
            where = f"{phase} failing on rank {failing} of {world_size}, rank {rank}"
            assert seconds < FAST_S, f"{where}: took {seconds:.1f} s"
            if rank == failing:
                assert error == kind and message.startswith(text), f"{where}: {message}"
                continue
            assert error == RELAYED.get(kind, kind), f"{where}: {error}: {message}"
            assert message.startswith(f"rank {failing} failed "), f"{where}: {message}"
            assert f"{kind}: {text}" in message, f"{where}: {message}"


def _loss_fails_on_last_stage(rank: int, world_size: int, init_file: str) -> tuple:
    from pdcompile.runtime.distributed import init_process_group

    init_process_group(rank, world_size, init_file=init_file, timeout_s=TIMEOUT_S)
    model, x, y, plan = case(world_size)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if module.steps >= 1:  # the second step
            raise ValueError("the targets are out of range")
        return F.cross_entropy(output, target)

    module = pdcompile.compile(model, (x,), loss_fn=loss_fn, plan=plan,
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                               timeout=TIMEOUT_S, startup_timeout=TIMEOUT_S)  # fmt: skip
    module.train_step(x, y)
    start = time.monotonic()
    try:
        module.train_step(x, y)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "none", "", time.monotonic() - start


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_loss_failing_on_the_last_stage_reaches_every_rank_by_name(world_size: int) -> None:
    outcomes = run_ranks(_loss_fails_on_last_stage, world_size, timeout_s=120)
    last = world_size - 1
    for rank, (error, message, seconds) in enumerate(outcomes):
        assert seconds < FAST_S, (rank, seconds)
        assert "the targets are out of range" in message, (rank, error, message)
        if rank != last:
            assert error == "StageCommError", (rank, error, message)
            assert f"rank {last} (stage {last})" in message, (rank, message)


def _dies_before_the_plan(rank: int, world_size: int, init_file: str) -> tuple:
    """Rank 1 exits right before the plan's broadcast; rank 0 reports what it saw."""
    from pdcompile.runtime import profile_load
    from pdcompile.runtime.distributed import init_process_group

    init_process_group(rank, world_size, init_file=init_file, timeout_s=TIMEOUT_S)
    model, x, y, plan = case(world_size)
    if rank == 1:
        profile_load.ProfileLoad.serve = lambda *args, **kwargs: os._exit(3)
    try:
        pdcompile.compile(model, (x,), loss_fn=F.cross_entropy, plan=plan,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), timeout=TIMEOUT_S,
                          startup_timeout=TIMEOUT_S)  # fmt: skip
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "none", ""


def test_a_rank_dying_before_the_plan_is_named() -> None:
    """Issue 31: it was "another rank" (gloo names a closed connection by its address only);
    the ranks mark their arrival in the store, so the one that never came is named."""
    rank0, rank1 = run_ranks(_dies_before_the_plan, 2, timeout_s=120, allow_failures=True)
    assert rank1.error == "exit"
    error, message = rank0.value
    assert error == "PipelineTimeoutError", message
    assert message.startswith("rank 0 gave up sending the plan to the other ranks"), message
    assert "from rank 0" not in message and ": rank 1 never arrived (died" in message, message


def _pack_fails_on_rank_0(rank: int, world_size: int, init_file: str) -> tuple:
    from pdcompile.runtime import wire
    from pdcompile.runtime.distributed import init_process_group

    init_process_group(rank, world_size, init_file=init_file, timeout_s=TIMEOUT_S)
    model, x, y, plan = case(world_size)
    module = pdcompile.compile(model, (x,), loss_fn=F.cross_entropy, plan=plan,
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                               timeout=TIMEOUT_S, startup_timeout=TIMEOUT_S)  # fmt: skip
    module.train_step(x, y)
    if rank == 0:

        def as_bytes(value: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("self.stride(-1) must be 1")

        wire.as_bytes = as_bytes
    start = time.monotonic()
    try:
        module.train_step(x, y)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "none", "", time.monotonic() - start


def test_a_message_that_cannot_be_packed_reaches_the_receiver_by_name() -> None:
    """The sender's error, not gloo's closed connection, on the rank waiting for the message."""
    (error0, message0, _), (error1, message1, seconds) = run_ranks(
        _pack_fails_on_rank_0, 2, timeout_s=120
    )
    assert error0 == "StageCommError" and "self.stride(-1) must be 1" in message0, message0
    assert message0.startswith("rank 0 could not pack its act of microbatch 0"), message0
    assert error1 == "StageCommError" and message0 in message1 and seconds < FAST_S, message1
