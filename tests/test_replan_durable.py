"""The closed loop is as durable as the training it moves (issue 31): a restarted job resumes on
the plan it moved to, with its count of skipped steps; a move leaves no temporary copy; a rank
dying while the move checkpoints names the move; bad policies are refused at construction."""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
import torch.nn.functional as F
from spawn import run_ranks
from test_replan import CLUSTER, _compile, _sgd, _shape, case, costs, synthetic

import pdcompile
from pdcompile import CheckpointError, PartitionError, Replan
from pdcompile.closed_loop.move import Replanner, check_folder

STEPS = 6
NAN_STEP = 1  # its targets hold a NaN: nonfinite="skip" skips it


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    _, x, y = case()
    bad = y.clone()
    bad[0, 0] = float("nan")
    return [(x * (1 + s / 10), bad if s == NAN_STEP else y) for s in range(STEPS)]


def test_bad_policies_are_refused_at_construction(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("")
    for kwargs, error, words in [
        ({"threshold": "0.1"}, PartitionError, "threshold must be a number"),
        ({"threshold": float("nan")}, PartitionError, "threshold"),
        ({"after_steps": True}, PartitionError, "after_steps must be an integer"),
        ({"timeline": 3}, PartitionError, "timeline must be a function"),
        ({"directory": 123}, CheckpointError, "directory must be a folder"),
        ({"directory": ""}, CheckpointError, "directory must be a folder"),
        ({"directory": tmp_path / "file"}, CheckpointError, "is a file"),
    ]:
        with pytest.raises(error, match=words):
            Replan(**kwargs)
    # a folder of other files: refused when compile makes the re-planner, before training
    with pytest.raises(CheckpointError, match="notes.txt"):
        check_folder(Replan(directory=tmp_path / "full").directory)
    assert Replan(directory=tmp_path / "new").directory == str(tmp_path / "new")


def test_due_fires_once_from_after_steps_on() -> None:
    replanner = Replanner(Replan(after_steps=3), None, lambda plan: None)
    assert [replanner.due(s) for s in (1, 2)] == [False, False]
    assert replanner.due(5)  # a job resumed past step 3 decides at its first step
    replanner.resumed = "ckpt/step-000004"  # resumed on the plan it had moved to: decided
    assert not replanner.due(6)


def _job(rank: int, box: dict, directory: str, true, wrong) -> pdcompile.PipelinedModule:
    _, x, _ = case()
    policy = Replan(after_steps=2, timeline=lambda: synthetic(box["pipe"].plan, true))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, _ = case()
        box["pipe"] = pdcompile.compile(
            model, (x[:4],), loss_fn=F.mse_loss, optimizer=_sgd, cluster=CLUSTER, costs=wrong,
            replan=policy, num_microbatches=4, timeout=10, nonfinite="skip",
            checkpoint_dir=directory, checkpoint_every=2,
        )  # fmt: skip
    return box["pipe"]


def _durable(rank: int, world_size: int, init_file: str, root: str, die: bool) -> dict:
    from pdcompile.runtime.distributed import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world_size, init_file=init_file, timeout_s=10)
    tempfile.tempdir = os.path.join(root, "tmp")  # where a move's temporary folder goes
    os.makedirs(tempfile.tempdir, exist_ok=True)
    true, wrong = costs()
    data, box = _batches(), {}
    first = _job(rank, box, os.path.join(root, "ckpt"), true, wrong)
    if die:  # rank 1 dies while the move checkpoints the running plan
        save = first.save
        first.save = lambda d: os._exit(3) if rank == 1 and "replan" in d else save(d)
        for step in range(3):
            first.train_step(*data[step])
        return {}
    out = {"first": _shape(first.plan)}
    out["losses"] = [first.train_step(*data[s]) for s in range(4)]  # moves after 2; saves at 2, 4
    out["moved"] = first.replanner.moved_at
    first.close()
    second = _job(rank, box, os.path.join(root, "ckpt"), true, wrong)
    out.update(resumed=second.resumed_from, steps=second.steps, skipped=second.skipped_steps,
               shape=_shape(second.plan), explain=second.explain())  # fmt: skip
    out["losses"] += [second.train_step(*data[s]) for s in range(second.steps, STEPS)]
    out.update(state=second.state_dict(), decided=second.replanner.decision,
               temporary=os.listdir(tempfile.tempdir))  # fmt: skip
    return out


def test_a_restarted_job_resumes_on_the_plan_it_moved_to(tmp_path) -> None:
    true, _ = costs()
    right = _compile(true, nonfinite="skip")
    reference = [right.train_step(*batch) for batch in _batches()]
    outcomes = run_ranks(_durable, 2, str(tmp_path), False, timeout_s=150)
    for out in outcomes:
        assert out["moved"] == 2 and out["first"] != out["shape"] == _shape(right.plan)
        assert out["resumed"].endswith("step-000004") and out["steps"] == 4
        assert out["skipped"] == 1 and out["decided"] is None  # no second decision
        assert "on the plan the job moved to after step 2" in out["explain"]
        assert out["temporary"] == []  # the move's copy of the state is gone
        assert out["losses"] == pytest.approx(reference, rel=1e-6, nan_ok=True)
        expected = right.state_dict()
        for name, tensor in out["state"].items():  # this rank's stage
            torch.testing.assert_close(tensor, expected[name], msg=name)


@pytest.mark.faults  # waits out a stopped or dead rank's timeout: the faults tier
def test_a_rank_dying_while_the_move_checkpoints_names_the_move(tmp_path) -> None:
    died = run_ranks(_durable, 2, str(tmp_path), True, timeout_s=90, allow_failures=True)
    assert died[1].message == "exit code 3" and died[0].error is not None
    assert "the move to the new plan (decided after step 2) stopped" in died[0].message
    assert os.listdir(tmp_path / "tmp") == []
