"""The closed loop (issue 20): `compile(..., replan=...)` measures the stages, re-plans and moves
the running job; the measured times are injected (`Replan.timeline`: synthetic events priced
from the true costs), so nothing here depends on this machine's timing."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from spawn import run_ranks

import pdcompile
from pdcompile import CostGraph, PartitionError, Plan, Replan
from pdcompile.passes.planning.replan_decision import (
    StageTime,
    decide,
    measured_stage_times,
    rescaled,
)
from pdcompile.passes.planning.stage_sums import node_sums
from pdcompile.passes.planning.timeline import Event

CLUSTER = "2@1GB/s"
STEPS = 4
WRONG = "_0"  # the first Linear, profiled 10x too slow


def case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers[:-1]), torch.randn(16, 256), torch.randn(16, 256)


def costs() -> tuple[CostGraph, CostGraph]:
    """The true (analytic) costs of `case()` at its 16 rows, and a profile with one node 10x."""
    model, x, _ = case()
    true = pdcompile.analyze(pdcompile.trace(model, (x,)), (x,), profile=False, progress=False)
    wrong = true.copy()
    for name in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s"):
        wrong.graph.nodes[WRONG][name] *= 10
    return true, wrong


def synthetic(plan: Plan, true: CostGraph) -> list[Event]:
    """What each stage of `plan` would measure if the machine ran at the true costs."""
    scale = plan.microbatch_size / true.batch_size
    events, t = [], 0.0
    for s in plan.stages:
        sums = node_sums(true, s.nodes)
        f, b = sums.forward_s * scale, sums.backward_s * scale
        for r in s.ranks:
            for m in range(plan.num_microbatches):
                events += [Event(r, "F", s.index, m, t, t + f), Event(r, "B", s.index, m, t, t + b)]
    return events


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _compile(
    costs: CostGraph, policy: Replan | bool = False, **kwargs
) -> pdcompile.PipelinedModule:
    model, x, _ = case()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pdcompile.compile(model, (x[:4],), loss_fn=F.mse_loss, optimizer=_sgd,
                                 cluster=CLUSTER, costs=costs, replan=policy,
                                 num_microbatches=4, **kwargs)  # fmt: skip


def _replanning(true: CostGraph, wrong: CostGraph, **kwargs) -> pdcompile.PipelinedModule:
    box: dict = {}
    policy = Replan(after_steps=2, timeline=lambda: synthetic(box["pipe"].plan, true), **kwargs)
    box["pipe"] = _compile(wrong, policy)
    return box["pipe"]


def _shape(plan: Plan) -> list[tuple[str, ...]]:
    return [s.nodes for s in plan.stages]


# -- the pieces ------------------------------------------------------------------------------


def test_stage_times_are_medians_with_a_split_backward_summed() -> None:
    events = [Event(0, "F", 0, m, 0.0, 1.0 + m) for m in range(3)]
    events += [Event(0, "I", 0, m, 0.0, 2.0) for m in range(3)]
    events += [Event(0, "W", 0, m, 0.0, 0.5) for m in range(3)]
    events += [Event(1, "F", 1, 0, 0.0, 4.0), Event(1, "B", 1, 0, 0.0, 8.0)]
    events += [Event(0, "send", 0, 0, 0.0, 9.0), Event(0, "update", 0, -1, 0.0, 9.0)]
    assert measured_stage_times(events) == {0: StageTime(2.0, 2.5, 3), 1: StageTime(4.0, 8.0, 1)}


def test_rescaled_costs_price_each_stage_at_what_it_measured() -> None:
    true, wrong = costs()
    plan = pdcompile.plan(wrong, CLUSTER, num_microbatches=4)
    measured = measured_stage_times(synthetic(plan, true))
    again = pdcompile.evaluate(plan, rescaled(wrong, plan, measured))
    for s in again.stages:
        assert s.forward_s == pytest.approx(measured[s.index].forward_s, rel=1e-9)
        assert s.backward_s == pytest.approx(measured[s.index].backward_s, rel=1e-9)
    assert wrong.graph.nodes[WRONG]["forward_s"] == 10 * true.graph.nodes[WRONG]["forward_s"]


def test_decide_moves_to_the_plan_of_the_true_costs_when_it_pays() -> None:
    true, wrong = costs()
    running = pdcompile.plan(wrong, CLUSTER, num_microbatches=4)
    right = pdcompile.plan(true, CLUSTER, num_microbatches=4)
    assert _shape(running) != _shape(right)
    decision = decide(wrong, running, measured_stage_times(synthetic(running, true)))
    assert decision.move and decision.gain > 0.1 and _shape(decision.new) == _shape(right)
    assert "moving" in decision.describe()
    stay = decide(wrong, running, measured_stage_times(synthetic(running, true)), threshold=0.9)
    assert not stay.move and "below the threshold" in stay.reason
    settled = decide(true, right, measured_stage_times(synthetic(right, true)))
    assert not settled.move and "same plan" in settled.reason


def test_bad_policies_and_a_plan_without_costs_are_refused() -> None:
    with pytest.raises(PartitionError, match="after_steps"):
        Replan(after_steps=0)
    with pytest.raises(PartitionError, match="threshold"):
        Replan(threshold=1.5)
    true, _ = costs()
    model, x, _ = case()
    plan = pdcompile.plan(true, CLUSTER)
    with pytest.raises(PartitionError, match="costs="):
        pdcompile.compile(model, (x,), loss_fn=F.mse_loss, optimizer=_sgd, plan=plan,
                          replan=True)  # fmt: skip
    with pytest.raises(PartitionError, match="replan must be"):
        pdcompile.compile(model, (x,), loss_fn=F.mse_loss, optimizer=_sgd, replan="yes")


# -- one process -----------------------------------------------------------------------------


def test_a_job_on_a_wrong_profile_moves_and_trains_as_if_planned_right() -> None:
    true, wrong = costs()
    _, x, y = case()
    pipe = _replanning(true, wrong)
    first = _shape(pipe.plan)
    losses = [pipe.train_step(x, y) for _ in range(STEPS)]
    right = _compile(true)
    assert first != _shape(right.plan) and _shape(pipe.plan) == _shape(right.plan)
    assert pipe.replanner.decision.move and pipe.replanner.moved_at == 2
    reference = [right.train_step(x, y) for _ in range(STEPS)]
    assert losses == pytest.approx(reference, rel=1e-6)
    for name, tensor in right.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], tensor, msg=name)
    text = pipe.explain()
    assert "re-planned from measured stage times" in text and "moving" in text
    assert "measured before the move" in text and "measured after the move" in text


def test_a_job_on_the_right_profile_stays() -> None:
    true, _ = costs()
    _, x, y = case()
    pipe = _replanning(true, true)
    before = _shape(pipe.plan)
    for _ in range(3):
        pipe.train_step(x, y)
    assert not pipe.replanner.decision.move and _shape(pipe.plan) == before


# -- two ranks -------------------------------------------------------------------------------


def _ranks(rank: int, world_size: int, init_file: str, directory: str, die: bool) -> dict:
    from pdcompile.runtime.distributed import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world_size, init_file=init_file, timeout_s=10)
    true, wrong = costs()
    _, x, y = case()
    box: dict = {}
    policy = Replan(after_steps=2, directory=directory,
                    timeline=lambda: synthetic(box["pipe"].plan, true))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, _ = case()
        box["pipe"] = pipe = pdcompile.compile(
            model, (x[:4],), loss_fn=F.mse_loss, optimizer=_sgd, cluster=CLUSTER, costs=wrong,
            replan=policy, num_microbatches=4, timeout=10,
        )  # fmt: skip
    if die and rank == 1:  # this rank dies during the move, after the checkpoint
        build = pipe.replanner.rebuild
        pipe.replanner.rebuild = lambda plan: os._exit(3) or build(plan)
    first = _shape(pipe.plan)
    losses = [pipe.train_step(x, y) for _ in range(STEPS)]
    return {"first": first, "last": _shape(pipe.plan), "losses": losses,
            "state": pipe.state_dict(), "moved": pipe.replanner.moved_at}  # fmt: skip


def test_two_ranks_move_together_and_a_rank_dying_in_the_move_loses_nothing(tmp_path) -> None:
    true, _ = costs()
    _, x, y = case()
    right = _compile(true)
    reference = [right.train_step(x, y) for _ in range(STEPS)]
    outcomes = run_ranks(_ranks, 2, str(tmp_path / "move"), False, timeout_s=120)
    for out in outcomes:
        assert out["first"] != out["last"] == _shape(right.plan) and out["moved"] == 2
        assert out["losses"] == pytest.approx(reference, rel=1e-6)
        for name, tensor in out["state"].items():
            torch.testing.assert_close(tensor, right.state_dict()[name], msg=name)
    # a rank dies after the checkpoint of the running plan: the checkpoint is whole and holds
    # the weights after the 2 steps before the move
    died = run_ranks(_ranks, 2, str(tmp_path / "die"), True, timeout_s=120, allow_failures=True)
    # rank 0's error is the cause's class (rank 1 never reached the new executor's agreement)
    assert died[1].message == "exit code 3" and died[0].error == "PipelineTimeoutError"
    assert "the running plan's checkpoint" in died[0].message
    assert Plan.load(str(tmp_path / "die") + ".next-plan.json").stages
    saved = pdcompile.load_full_state_dict(str(tmp_path / "die"))
    two = _compile(true)
    for _ in range(2):
        two.train_step(x, y)
    for name, tensor in two.state_dict().items():
        torch.testing.assert_close(saved[name], tensor, msg=name)


def test_plan_command_replans_from_a_recorded_trace(tmp_path, capsys) -> None:
    from pdcompile.cli.handlers import main
    from pdcompile.passes.planning.timeline import load_trace, trace_meta

    true, wrong = costs()
    _, x, y = case()
    pipe = _compile(wrong)
    for _ in range(2):
        pipe.train_step(x, y)
    trace, graph = tmp_path / "run.json", tmp_path / "costs.json"
    pipe.save_trace(trace)
    wrong.save(graph)
    assert Plan.from_dict(trace_meta(trace)["plan"]).stages == pipe.plan.stages
    measured = measured_stage_times(load_trace(trace))
    assert sorted(measured) == [0, 1] and all(t.count == 8 for t in measured.values())
    code = main(["plan", str(graph), "--cluster", CLUSTER, "--measured", str(trace),
                 "--out", str(tmp_path / "new.json")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "re-planned from measured stage times" in out
    assert "stage 1: measured forward" in out and Plan.load(tmp_path / "new.json").stages
    bare = tmp_path / "bare.json"
    bare.write_text(trace.read_text().replace('"plan"', '"other"'))
    assert main(["plan", str(graph), "--cluster", CLUSTER, "--measured", str(bare)]) == 1
    assert "holds no plan" in capsys.readouterr().err


def test_microbatch_numbers_repeat_from_step_to_step() -> None:
    """Each step numbers its microbatches from 0: two steps' backwards of microbatch 0 are two
    backwards, and an I pairs with the W after it."""
    steps = []
    for t in (0.0, 10.0):
        steps += [Event(0, "F", 0, 0, t, t + 1.0), Event(0, "I", 0, 0, t + 1, t + 3.0),
                  Event(0, "W", 0, 0, t + 3, t + 4.0)]  # fmt: skip
    assert measured_stage_times(steps) == {0: StageTime(1.0, 3.0, 2)}
    fused = [Event(0, "F", 0, 0, t, t + 1.0) for t in (0.0, 5.0)]
    fused += [Event(0, "B", 0, 0, t + 1, t + 3.0) for t in (0.0, 5.0)]
    assert measured_stage_times(fused) == {0: StageTime(1.0, 2.0, 2)}
