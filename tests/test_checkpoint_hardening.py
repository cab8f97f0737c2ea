"""Checkpoints under stuck and dead ranks, name collisions and files that are not regular.

- A rank stopped (SIGSTOP) in the middle of a save or a load: the others give up after the step
  `timeout`, not the start-up's, warn as for a stuck step while they wait, and every rank ends
  in `PipelineTimeoutError`; the checkpoint on disk stays whole and the run goes on.
- A rank killed (SIGKILL) during a save: every survivor raises `PipelineTimeoutError` at once.
- A save into one checkpoint never touches another, whatever their names: what an interrupted
  save left is found in its journal, not by a prefix.
- A FIFO in place of a shard (the manifest edited to match) is refused, not opened.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pipeline_support import OPTIMIZERS, mlp_case
from spawn import run_ranks
from support import WarningRecords
from torch.distributed.checkpoint import FileSystemWriter

import pdcompile
from pdcompile.core.errors import CheckpointError, PdcompileError
from pdcompile.runtime import checkpoint, manifest
from pdcompile.runtime.distributed import init_process_group

WATCHDOG = re.compile(
    r"rank 0 has waited \d+ s (saving|loading) checkpoint \S+ \(([a-z ]+)\) with ranks \[1\] "
    r"\(it gives up after 3 s\)"
)


def _stop_once(owner: object, name: str) -> None:
    """Make `owner.name` stop this process (SIGSTOP) at its next call, then run as before."""
    original = getattr(owner, name)

    def stopped(*args: object, **kwargs: object) -> object:
        setattr(owner, name, original)
        os.kill(os.getpid(), signal.SIGSTOP)
        return original(*args, **kwargs)

    setattr(owner, name, stopped)


def _outcome(run: object) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        run()  # type: ignore[operator]
        return ("returned", "", time.monotonic() - start)
    except PdcompileError as exc:
        return (type(exc).__name__, str(exc), time.monotonic() - start)


def _stuck(rank: int, world_size: int, init_file: str, root: str) -> dict:
    """Rank 1 stops in a save's writes, then in a load's hashing; rank 0 resumes it each time
    once it has given up. The start-up timeout is 60 s, the step timeout 3 s."""
    init_process_group(rank, world_size, init_file=init_file, backend="gloo", timeout_s=60)
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    model, x, y, loss_fn = mlp_case()
    pipe = pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"],
                             cluster="2", solver="uniform", profile=False, timeout=3)  # fmt: skip
    records = WarningRecords()
    logging.getLogger("pdcompile.runtime.checkpoint_ranks").addHandler(records)
    pipe.train_step(x, y)
    directory = os.path.join(root, "ckpt")
    pipe.save(directory)
    result = {}
    for case, stop, act in [
        ("save", (FileSystemWriter, "write_data"), lambda: pipe.save(directory)),
        ("load", (manifest, "verify"), lambda: pipe.load(directory)),
    ]:
        if rank == 1:
            _stop_once(*stop)
        done = os.path.join(root, f"{case}.done")
        try:
            result[case] = _outcome(act)
        finally:
            if rank == 1:
                open(done, "w").close()
            deadline = time.monotonic() + 60
            while rank == 0 and not os.path.exists(done) and time.monotonic() < deadline:
                os.kill(pids[1], signal.SIGCONT)  # until it is past its stop
                time.sleep(0.2)
        dist.barrier()  # the default group is not the save's: it still works
    pipe.train_step(x, y)  # and so does the pipeline
    pipe.save(directory)
    pipe.load(directory)
    result["log"] = records.messages
    result["step"] = manifest.read(directory).step
    return result


@pytest.mark.faults  # waits out a stopped or dead rank's timeout: the faults tier
def test_a_stopped_rank_ends_a_save_and_a_load_after_the_step_timeout(tmp_path: Path) -> None:
    ranks = run_ranks(_stuck, 2, str(tmp_path), timeout_s=150)
    for rank, result in enumerate(ranks):
        for case, what in (("save", "writing its files"), ("load", "verifying its checksums")):
            kind, message, elapsed = result[case]
            assert kind == "PipelineTimeoutError", (rank, case, message)
            verb = "saving" if case == "save" else "loading"
            assert f"rank {rank} gave up {verb} checkpoint {tmp_path / 'ckpt'} (" in message
            assert "(timeout 3 s)" in message and "a rank died or hangs" in message, message
            if rank == 0:  # it waited for the stopped rank until the timeout, not 60 s
                assert what in message and 2.5 <= elapsed < 30, (elapsed, message)
                # and names it: gloo's timeout names no rank, rank 1's signs of life stood still
                assert "rank 1 stopped (no sign of life" in message, message
        assert ("is unchanged" in result["save"][1]) and "nothing was loaded" in result["load"][1]
        assert result["step"] == 2  # the run went on and saved again
    warned = {m.group(2) for m in map(WATCHDOG.fullmatch, ranks[0]["log"]) if m}
    assert warned >= {"writing its files", "verifying its checksums"}, ranks[0]["log"]


def _killed(
    rank: int, world_size: int, init_file: str, root: str, point: str, timeout_s: float | None
) -> dict:
    """Three ranks save twice; rank 2 kills itself (SIGKILL) during the second save."""
    init_process_group(rank, world_size, init_file=init_file, backend="gloo", timeout_s=60)
    stage = torch.nn.ModuleDict({f"stage{rank}": torch.nn.Linear(4, 4)})
    directory = os.path.join(root, "ckpt")
    options = dict(model=stage, optimizer=None, extra={})
    options.update({} if timeout_s is None else {"timeout_s": timeout_s})  # None: as before
    checkpoint.save(directory, step=1, **options)
    if rank == 2:
        owner, name = (dist, "all_gather_object") if point == "agreeing" else (
            FileSystemWriter, "write_data")  # fmt: skip
        setattr(owner, name, lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL))
    with torch.no_grad():
        stage[f"stage{rank}"].weight.add_(1.0)
    save = lambda: checkpoint.save(directory, step=2, **options)  # noqa: E731
    return dict(zip(("kind", "message", "elapsed"), _outcome(save), strict=True))


# in the default group (its timeout 60 s), and in a save's own (30 s)
@pytest.mark.parametrize(("point", "timeout_s"), [("agreeing", None), ("writing", 30)])
def test_the_survivors_of_a_rank_killed_mid_save_raise_the_timeout_error(
    tmp_path: Path, point: str, timeout_s: float | None
) -> None:
    outcomes = run_ranks(_killed, 3, str(tmp_path), point, timeout_s, timeout_s=120,
                         allow_failures=True)  # fmt: skip
    assert outcomes[2].error == "exit", outcomes[2]
    for rank in (0, 1):
        result = outcomes[rank].value
        assert outcomes[rank].ok and result["kind"] == "PipelineTimeoutError", result
        assert f"rank {rank} gave up saving checkpoint {tmp_path / 'ckpt'}" in result["message"]
        assert result["elapsed"] < 10, result  # at once, not after a timeout: the peer is dead
    assert manifest.read(str(tmp_path / "ckpt")).step == 1  # the previous one, whole
    assert sorted(checkpoint.load_full_state_dict(tmp_path / "ckpt")) == [
        f"stage{r}.{p}" for r in range(3) for p in ("bias", "weight")
    ]


# name collisions ------------------------------------------------------------------------------


class _Killed(BaseException):
    """Ends a save where a SIGKILL would: nothing of the save's own cleanup runs."""


def _save(directory: Path, value: float) -> None:
    module = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(module.weight, value)
    checkpoint.save(directory, model=module, optimizer=None, extra={}, step=int(value))


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (symlinks not followed): its digest."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            found[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _weight(directory: Path) -> float:
    return checkpoint.load_full_state_dict(directory)["weight"][0, 0].item()


def test_a_save_never_touches_another_checkpoints_leftovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    others = ["run.old-best", ".run.tmp-x", ".run.old-0123abcd", ".run.tmp-89abcdef", "run-2"]
    for value, name in enumerate(others, start=10):
        _save(tmp_path / name, value)
    # a save into run.old-best killed between its renames: its previous checkpoint waits aside
    rename = os.rename

    def killed(source: str, target: str) -> None:
        if os.path.basename(source).startswith(".run.old-best.tmp-"):
            raise _Killed
        rename(source, target)

    monkeypatch.setattr(os, "rename", killed)
    with pytest.raises(_Killed):
        _save(tmp_path / "run.old-best", 1)
    monkeypatch.undo()
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith(".run.old-best.old-")]
    before = _snapshot(tmp_path)

    for value in (2, 3):  # into a missing `run`, then over it
        _save(tmp_path / "run", value)
        assert _weight(tmp_path / "run") == value
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("run/")} == before
    with pytest.raises(CheckpointError, match=re.escape(f"the previous checkpoint is {aside}")):
        checkpoint.load_full_state_dict(tmp_path / "run.old-best")
    _save(tmp_path / "run.old-best", 4)  # puts the previous one back first, then replaces it
    assert _weight(tmp_path / "run.old-best") == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*others, "run"])
    for value, name in enumerate(others, start=10):
        if name != "run.old-best":
            assert _weight(tmp_path / name) == value, name
    with pytest.raises(CheckpointError, match=r"extra\['x'\] is a str"):  # refused: no record left
        checkpoint.save(tmp_path / "run", model=torch.nn.Linear(2, 2), optimizer=None,
                        extra={"x": "text"})  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*others, "run"])


@pytest.mark.timeout(60)  # opened, the FIFO would block until then
def test_a_fifo_in_place_of_a_shard_is_refused_not_opened(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    _save(directory, 1)
    shard = directory / "__0_0.distcp"
    shard.unlink()
    os.mkfifo(shard)
    doc = json.loads((directory / "manifest.json").read_text())
    doc["files"]["__0_0.distcp"] = {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    (directory / "manifest.json").write_text(json.dumps(doc))
    for load in (checkpoint.load_full_state_dict, lambda d: checkpoint.load(
            d, model=torch.nn.Linear(2, 2))):  # fmt: skip
        with pytest.raises(CheckpointError, match="__0_0.distcp is a FIFO, not a regular file"):
            load(directory)


def test_a_group_and_a_timeout_are_not_both_taken(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="both process_group and timeout_s=5: a group's"):
        checkpoint.save(tmp_path / "ckpt", model=torch.nn.Linear(2, 2), optimizer=None, extra={},
                        process_group=object(), timeout_s=5)  # fmt: skip
    assert list(tmp_path.iterdir()) == []
