"""`compile(checkpoint_dir=, checkpoint_every=)` in one process (one stage, so `save` needs no
process group): a resumed job equals an uninterrupted one, a damaged newest checkpoint is
skipped with a warning naming it, pruning keeps the newest valid ones, and bad arguments are
refused. Two hosts and torchrun restarts: tests/test_multihost.py."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from pipeline_support import OPTIMIZERS, mlp_case, varied_batches

import pdcompile
from pdcompile.core.errors import CheckpointError
from pdcompile.runtime import auto_resume


def _compiled(directory, every: int = 2, cluster=None):
    model, x, _, loss_fn = mlp_case()
    return pdcompile.compile(
        model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["adam"], cluster=cluster,
        solver="uniform", profile=False, checkpoint_dir=directory, checkpoint_every=every,
    )  # fmt: skip


def _train(pipe, data, until: int) -> None:
    for step in range(pipe.steps, until):  # the data position is the caller's: batch `steps`
        pipe.train_step(*data[step])


def test_a_resumed_job_equals_an_uninterrupted_one(tmp_path) -> None:
    model, x, y, _ = mlp_case()
    data = varied_batches(x, y, 7)
    whole = _compiled(tmp_path / "whole")
    assert whole.resumed_from is None and whole.steps == 0  # an empty folder: a fresh start
    _train(whole, data, 7)
    first = _compiled(tmp_path / "cut")
    _train(first, data, 5)  # saved after 2 and 4 steps; step 5 is lost with the process
    second = _compiled(tmp_path / "cut")
    assert second.resumed_from == str(tmp_path / "cut" / "step-000004") and second.steps == 4
    _train(second, data, 7)
    expected, got = whole.state_dict(), second.state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    assert auto_resume.listed(str(tmp_path / "cut")) == [
        (s, str(tmp_path / "cut" / f"step-{s:06d}")) for s in (6, 4, 2)
    ]  # fmt: skip


def test_a_damaged_newest_checkpoint_is_skipped_and_pruning_passes_it_by(tmp_path, caplog) -> None:
    model, x, y, _ = mlp_case()
    data = varied_batches(x, y, 12)
    _train(_compiled(tmp_path), data, 4)
    torn = tmp_path / "step-999999"
    shutil.copytree(tmp_path / "step-000004", torn)
    os.remove(next(torn.glob("*.distcp")))
    (tmp_path / ".step-000006.tmp-0a1b2c3d").mkdir()  # what a save killed midway leaves
    with caplog.at_level(logging.WARNING, logger=auto_resume.__name__):
        pipe = _compiled(tmp_path)
    assert pipe.resumed_from == str(tmp_path / "step-000004") and pipe.steps == 4
    assert any(f"skipping checkpoint {torn}" in r.getMessage() for r in caplog.records)
    _train(pipe, data, 12)  # saves at 6, 8, 10, 12: the newest 3 valid ones stay
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == ["step-000008", "step-000010", "step-000012", "step-999999"]


def test_bad_arguments_are_refused(tmp_path) -> None:
    model, x, _, loss_fn = mlp_case()
    options = dict(loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"], profile=False)
    with pytest.raises(CheckpointError, match="checkpoint_every was given without checkpoint_dir"):
        pdcompile.compile(model, (x,), checkpoint_every=2, **options)
    with pytest.raises(CheckpointError, match="checkpoint_dir was given without checkpoint_every"):
        pdcompile.compile(model, (x,), checkpoint_dir=str(tmp_path), **options)
    with pytest.raises(CheckpointError, match=r"checkpoint_every=0: give the number of train"):
        pdcompile.compile(model, (x,), checkpoint_dir=tmp_path, checkpoint_every=0, **options)
    for blank in ("", "  "):  # not the current directory
        with pytest.raises(CheckpointError, match=f"checkpoint_dir='{blank}' names no folder"):
            pdcompile.compile(model, (x,), checkpoint_dir=blank, checkpoint_every=1, **options)
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="is a file: give a folder"):
        pdcompile.compile(model, (x,), checkpoint_dir=tmp_path / "file", checkpoint_every=1,
                          **options)  # fmt: skip
    with pytest.raises(CheckpointError, match="checkpoints one stage per process"):
        _compiled(tmp_path / "two", cluster=2)  # this process would run both stages
