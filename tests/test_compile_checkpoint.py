"""Checkpoints of compiled models: resume equals an uninterrupted run (every schedule), a
checkpoint of a 2-stage run loads under a 3-stage plan, and into the original model."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from pipeline_support import CASES, OPTIMIZERS
from spawn import run_ranks

import pdcompile
from pdcompile.core.errors import PdcompileError
from pdcompile.runtime.distributed import init_process_group

SCHEDULES = ("1f1b", "pipedream", "2bw")
# a scheduler with state besides last_epoch (T_cur, T_i): from the fifth update on, its learning
# rate after a resume is right only if that state was saved
WARM_RESTARTS = lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, 1, 2)  # noqa: E731


def _compiled(case: str, schedule: str):
    model, x, y, loss_fn = CASES[case]()
    pipe = pdcompile.compile(
        model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["adam"], schedule=schedule,
        solver="uniform", profile=False, lr_scheduler=WARM_RESTARTS,
    )  # fmt: skip
    return pipe, x, y


def _resume(rank: int, world_size: int, init_file: str, directory: str) -> dict:
    init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    out = {}
    for schedule in SCHEDULES:
        whole, x, y = _compiled("gpt", schedule)
        for step in range(5):
            if step == 2:
                whole.flush()  # a save flushes: the uninterrupted run flushes there too
            whole.train_step(x, y)
        first, x, y = _compiled("gpt", schedule)
        for _ in range(2):
            first.train_step(x, y)
        path = os.path.join(directory, schedule)
        first.save(path)
        second, x, y = _compiled("gpt", schedule)
        second.load(path)
        losses = [second.train_step(x, y) for _ in range(3)]
        out[schedule] = (whole.state_dict(), second.state_dict(), losses)
    dist.destroy_process_group()
    return out


def _reshard(rank: int, world_size: int, init_file: str, directory: str) -> dict:
    init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    pipe, _, _ = _compiled("gpt", "1f1b")
    pipe.load(os.path.join(directory, "1f1b"))
    state = pipe.state_dict()
    dist.destroy_process_group()
    return {"stages": pipe.plan.num_stages, "state": state}


def test_resume_equals_uninterrupted_and_checkpoints_reshard(tmp_path) -> None:
    directory = str(tmp_path)
    results = run_ranks(_resume, 2, directory, timeout_s=300)
    for schedule in SCHEDULES:
        for rank, out in enumerate(results):
            whole, resumed, losses = out[schedule]
            assert whole.keys() == resumed.keys()
            for name in whole:
                torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=0,
                                           msg=f"{schedule} rank {rank}: {name}")  # fmt: skip
    # the 2-stage checkpoint under a 3-stage plan
    three = run_ranks(_reshard, 3, directory, timeout_s=300)
    assert {r["stages"] for r in three} == {3}
    full = pdcompile.load_full_state_dict(os.path.join(directory, "1f1b"))
    merged = {n: t for r in three for n, t in r["state"].items()}
    assert merged.keys() == full.keys()
    for name, tensor in full.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=0, msg=name)
    model = CASES["gpt"]()[0]
    model.load_state_dict(full, strict=True)  # plain PyTorch use
    saved_after_two_steps = results[0]["1f1b"][0]  # not the checkpoint: it is 2 steps later
    assert not torch.equal(saved_after_two_steps["wte.weight"], full["wte.weight"])


def test_checkpoints_need_one_rank_per_process(tmp_path) -> None:
    model, x, _, loss_fn = CASES["mlp"]()
    pipe = pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"],
                             cluster="2", solver="uniform", profile=False)  # fmt: skip
    with pytest.raises(PdcompileError, match="one rank per process"):  # this process runs both
        pipe.save(str(tmp_path / "checkpoint"))
