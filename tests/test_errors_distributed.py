"""Failures across ranks: no rank waits forever, and every error names the rank at fault.

Also the non-finite loss option (`nonfinite="raise"` or `"skip"`), in one process and on two
gloo ranks. Covered elsewhere: a rank that dies
(tests/test_distributed_executor.py::test_a_dead_rank_stops_the_others_with_a_timeout_error) and a
rank started with another model
(tests/test_compile.py::test_a_rank_with_another_model_fails_the_fingerprint_check).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import time

import pytest
import torch
from pipeline_support import OPTIMIZERS, accumulate_reference, mlp_case
from spawn import run_ranks
from support import WarningRecords

import pdcompile
from pdcompile import Cluster
from pdcompile.core.errors import LossError, PdcompileError, ScheduleError
from pdcompile.passes.planning.validate import validate_schedule
from pdcompile.runtime.distributed import init_process_group
from pdcompile.scheduling import build_schedule

SGD = OPTIMIZERS["sgd"]  # with momentum: a skipped step must not touch its state either
STEP_LR = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)  # noqa: E731
OPTIONS = dict(cluster="2", solver="uniform", profile=False)  # 2 stages, 4 microbatches


def _poisoned(x: torch.Tensor) -> torch.Tensor:
    bad = x.clone()
    bad[5, 3] = float("nan")  # 12 rows in 4 microbatches: row 5 is in microbatch 1
    return bad


def _skip_steps(pipe, x, y) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Losses and this process's weights after a good, a NaN, and two good steps."""
    losses, states = [], []
    for batch in (x, _poisoned(x), x, x):
        losses.append(pipe.train_step(batch, y))
        states.append({n: t.clone() for n, t in pipe.state_dict().items()})
    return losses, states


def _check_skipped(losses, states, model, x, y, loss_fn) -> None:
    assert math.isnan(losses[1]) and all(math.isfinite(v) for v in losses[::2])
    for name, tensor in states[1].items():
        assert torch.equal(tensor, states[0][name]), name  # the NaN step changed nothing
    reference, _ = accumulate_reference(model, x, y, loss_fn, SGD, 4, 3, scheduler=STEP_LR)
    for name, tensor in states[3].items():
        torch.testing.assert_close(tensor, reference.state_dict()[name], msg=name)


def test_skip_in_one_process_drops_the_step_and_trains_on_like_the_reference() -> None:
    model, x, y, loss_fn = mlp_case()
    pipe = pdcompile.compile(copy.deepcopy(model), (x,), loss_fn=loss_fn, optimizer=SGD,
                             lr_scheduler=STEP_LR, nonfinite="skip", **OPTIONS)  # fmt: skip
    losses, states = _skip_steps(pipe, x, y)
    _check_skipped(losses, states, model, x, y, loss_fn)
    assert pipe.skipped_steps == 1
    for worker in pipe.pipeline.workers.values():  # three updates, three scheduler steps
        assert worker.versions.updates == 3 and worker.scheduler.last_epoch == 3


def test_raise_in_one_process_names_the_step_stage_and_microbatch() -> None:
    model, x, y, loss_fn = mlp_case()
    pipe = pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=SGD, **OPTIONS)
    pipe.train_step(x, y)
    with pytest.raises(LossError) as info:
        pipe.train_step(_poisoned(x), y)
    message = str(info.value)
    assert "the loss is nan in step 1, at stage 1 (rank 1), microbatch 1" in message
    assert "nonfinite='skip' skips such steps" in message


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_skip_is_refused_for_asynchronous_schedules_before_capture(schedule) -> None:
    model, x, _, loss_fn = mlp_case()
    with pytest.raises(ScheduleError, match=f"nonfinite='skip' needs a synchronous schedule .* "
                       f"under {schedule} updates"):  # fmt: skip
        pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=SGD, schedule=schedule,
                          nonfinite="skip", **OPTIONS)  # fmt: skip
    with pytest.raises(ScheduleError, match="nonfinite must be one of"):
        pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=SGD, nonfinite="ignore")


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_every_rank_checks_before_its_update_and_the_schedule_validates(kind) -> None:
    ranks, edges = [[0, 1], [2]], {(0, 1): True}
    schedule = build_schedule(kind, ranks, edges, 4, clip=True, skip_nonfinite=True)
    validate_schedule(schedule)
    for actions in schedule.actions.values():
        kinds = [a.kind for a in actions if a.microbatch < 0]
        assert kinds[-3:] == ["check", "clip", "step"]
        assert next(a for a in actions if a.kind == "check").group == (0, 1, 2)


def _nonfinite(rank: int, world_size: int, init_file: str) -> dict:
    init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    model, x, y, loss_fn = mlp_case()
    pipe = pdcompile.compile(copy.deepcopy(model), (x,), loss_fn=loss_fn, optimizer=SGD,
                             lr_scheduler=STEP_LR, nonfinite="skip", **OPTIONS)  # fmt: skip
    losses, states = _skip_steps(pipe, x, y)
    result = {"losses": losses, "states": states, "skipped": pipe.skipped_steps}
    pipe = pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=SGD, timeout=120, **OPTIONS)
    pipe.train_step(x, y)
    try:
        pipe.train_step(_poisoned(x), y)
    except PdcompileError as exc:
        result["raised"] = (type(exc).__name__, str(exc))
    return result


def test_nonfinite_losses_on_two_ranks() -> None:
    model, x, y, loss_fn = mlp_case()
    results = run_ranks(_nonfinite, 2, timeout_s=200)
    for result in results:
        _check_skipped(result["losses"], result["states"], model, x, y, loss_fn)
        assert result["skipped"] == 1
    # the last stage raises; rank 0, waiting for a gradient, gets its error in the message
    # (not after its 120 s timeout: that would be a PipelineTimeoutError)
    kind, message = results[1]["raised"]
    assert kind == "LossError" and "the loss is nan in step 1, at stage 1 (rank 1)" in message
    kind, message = results[0]["raised"]
    assert kind == "StageCommError", message
    assert "rank 1 (stage 1) stopped at F1 in step 1: LossError: the loss is nan" in message


def _mismatches_then_hang(rank: int, world_size: int, init_file: str) -> dict:
    init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    model, x, y, loss_fn = mlp_case()
    result = {}
    costs = pdcompile.analyze(pdcompile.trace(model, (x,)), (x,), profile=False)
    for case, plan in [
        ("plan", pdcompile.plan(costs, Cluster.parse("2"), solver=("uniform", "blocks")[rank])),
        ("world", pdcompile.plan(costs, Cluster.parse("3"), solver="uniform")),
    ]:
        try:
            pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=SGD, plan=plan)
        except PdcompileError as exc:
            result[case] = (type(exc).__name__, str(exc))
    # rank 1 cannot capture its model; then rank 0 cannot plan: every rank stops at once
    for case, options in [
        ("capture", dict(example_inputs=(x,) if rank == 0 else (x[:, :8],))),
        ("planning", dict(example_inputs=(x,), cluster=Cluster.parse("2", memory="1KB"))),
    ]:
        try:
            pdcompile.compile(model, loss_fn=loss_fn, optimizer=SGD, profile=False, **options)
        except PdcompileError as exc:
            result[case] = (type(exc).__name__, str(exc))

    with open(f"{init_file}.rank{rank}.json", "w") as f:  # rank 1 will not return
        json.dump(result, f)
    released = init_file + ".released"
    calls = []

    def hangs_in_step_two(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if rank == 1 and len(calls) > 4:  # step 2, microbatch 0: sleep until rank 0 is done
            deadline = time.monotonic() + 120
            while not os.path.exists(released) and time.monotonic() < deadline:
                time.sleep(0.1)
            os._exit(0)
        return loss_fn(out, target)

    pipe = pdcompile.compile(model, (x,), loss_fn=hangs_in_step_two, optimizer=SGD, timeout=5,
                             **OPTIONS)  # fmt: skip
    records = WarningRecords()
    logging.getLogger("pdcompile.runtime.distributed").addHandler(records)
    pipe.train_step(x, y)
    start = time.monotonic()
    try:
        pipe.train_step(x, y)
    except PdcompileError as exc:
        result["hang"] = (type(exc).__name__, str(exc), time.monotonic() - start)
    finally:
        open(released, "w").close()
    result["log"] = records.messages
    with open(f"{init_file}.rank1.json") as f:
        result["rank 1"] = json.load(f)
    return result


@pytest.mark.faults  # waits out a stopped or dead rank's timeout: the faults tier
def test_mismatched_plans_and_a_hanging_rank() -> None:
    outcomes = run_ranks(_mismatches_then_hang, 2, timeout_s=240, allow_failures=True)
    assert outcomes[1].error == "exit", outcomes[1]  # it hung until rank 0 released it
    result = outcomes[0].value
    assert outcomes[0].ok, outcomes[0]
    kind, message = result["plan"]  # a rank started with another plan
    assert kind == "PdcompileError" and "ranks [1] captured another model or call" in message
    kind, message = result["world"]
    assert kind == "PartitionError" and "places its stages on 3 devices" in message
    kind, message = result["capture"]
    assert kind == "PdcompileError" and "rank 1 could not capture the model" in message
    assert "TraceError: no path could capture MLP" in message
    assert result["planning"][0] == "PartitionError"  # rank 0's own error, and rank 1:
    kind, message = result["rank 1"]["planning"]
    assert kind == "PdcompileError" and "rank 0 could not plan, so no rank can start" in message
    assert "PartitionError: no plan fits" in message  # recomputing too, and it names the least
    kind, message, elapsed = result["hang"]
    assert kind == "PipelineTimeoutError", message
    waited = re.search(
        r"rank 0 gave up receiving grad of microbatch 0 \(stage 0 -> 1\) with rank 1 after "
        r"waiting ([\d.]+) s \(timeout 5 s\)",
        message,
    )
    assert waited and float(waited.group(1)) >= 4.5, message
    assert elapsed < 60  # the timeout ends the wait, not rank 1 (released after 120 s)
    watchdog = [m for m in result["log"] if m.startswith("rank 0 has waited")]
    assert any(
        re.fullmatch(
            r"rank 0 has waited \d+ s receiving grad of microbatch 0 \(stage 0 -> 1\) with "
            r"rank 1 \(it gives up after 5 s\)",
            m,
        )
        for m in watchdog
    ), result["log"]
