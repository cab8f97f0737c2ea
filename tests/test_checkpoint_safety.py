"""Checkpoints safe against strangers, neighbours and full disks (issue 31).

A `.metadata` holding a pickle payload, with `manifest.json` fixed up to match, is refused
unrun; two jobs saving into one folder do not destroy each other's saves; a full disk is named
as such and leaves no staging folder; pruning removes what killed saves left.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pdcompile.core.errors import CheckpointError
from pdcompile.runtime import checkpoint, manifest
from pdcompile.zoo import MLP


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _save(directory: Path, seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    module = MLP(p=0.0)
    checkpoint.save(directory, model=module, optimizer=None, extra={}, step=seed)
    return module


def _plant(directory: Path, payload: bytes) -> None:
    """Replace `.metadata` by `payload` and fix the manifest's checksum up to match."""
    (directory / ".metadata").write_bytes(payload)
    doc = json.loads((directory / "manifest.json").read_text())
    digest = manifest.sha256(str(directory / ".metadata"))
    doc["files"][".metadata"] = {"bytes": len(payload), "sha256": digest}
    (directory / "manifest.json").write_text(json.dumps(doc))


def test_a_pickle_payload_in_the_metadata_runs_nothing(tmp_path: Path) -> None:
    directory, marker = tmp_path / "ckpt", tmp_path / "ran"
    _save(directory)
    _plant(directory, pickle.dumps(_Payload(marker), protocol=4))
    for load in (
        lambda: checkpoint.load_full_state_dict(directory),
        lambda: checkpoint.load(directory, model=MLP(p=0.0)),
    ):
        with pytest.raises(CheckpointError, match=r"\.metadata names posix\.system, which DCP"):
            load()
        assert not marker.exists()
    # a payload hidden inside real metadata (the entries' dataclasses around it) too
    _save(directory)
    real = pickle.loads((directory / ".metadata").read_bytes())
    real.planner_data = _Payload(marker)
    _plant(directory, pickle.dumps(real, protocol=4))
    with pytest.raises(CheckpointError, match="names posix.system"):
        checkpoint.load_full_state_dict(directory)
    assert not marker.exists()


_CHILD = """
import os, sys, time, torch
from pdcompile.runtime import checkpoint, manifest
from pdcompile.zoo import MLP

directory, marker, go = sys.argv[1:]
torch.set_num_threads(1)
sha256 = manifest.sha256


def held(path):  # every file written, the manifest not yet: wait for the other job
    open(marker, "w").close()
    while not os.path.exists(go):
        time.sleep(0.05)
    return sha256(path)


manifest.sha256 = held
torch.manual_seed(1)
checkpoint.save(directory, model=MLP(p=0.0), optimizer=None, extra={}, step=1)
"""


@pytest.mark.timeout(120)
def test_a_second_job_saving_into_the_same_name_is_refused_and_the_first_lands(
    tmp_path: Path,
) -> None:
    directory, marker, go = tmp_path / "ckpt", tmp_path / "writing", tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", _CHILD, str(directory), str(marker), str(go)],
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "the first job did not start writing"
            time.sleep(0.05)
        staging = [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")]
        with pytest.raises(CheckpointError, match=f"another save into it is under way \\(pid "
                           f"{first.pid} on host "):  # fmt: skip
            _save(directory, seed=2)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")] == staging
        go.touch()
        assert first.wait(timeout=60) == 0, first.stderr.read()
    finally:
        first.kill()
        first.wait()
        first.stderr.close()
    torch.manual_seed(1)
    for name, tensor in MLP(p=0.0).state_dict().items():  # the first job's save landed
        assert torch.equal(checkpoint.load_full_state_dict(directory)[name], tensor), name
    _save(directory, seed=2)  # its lease is gone with it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "go", "writing"]


def test_a_full_disk_is_named_and_leaves_no_staging_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "ckpt"
    previous = _save(directory).state_dict()

    def full(fd: int) -> None:  # DCP syncs each file it writes; NFS reports ENOSPC there
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError, match=f"the disk holding {tmp_path} is full \\(.* free;"):
        _save(directory, seed=1)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging, journal, lease
    loaded = checkpoint.load_full_state_dict(directory)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in previous.items())


def test_pruning_removes_the_journals_and_leases_killed_saves_left(tmp_path: Path) -> None:
    from pdcompile.runtime.auto_resume import AutoCheckpoint

    auto = AutoCheckpoint(str(tmp_path), every=1, keep=1)
    module = MLP(p=0.0)
    saving = lambda path: checkpoint.save(path, model=module, optimizer=None, extra={})  # noqa: E731
    auto.save(saving, 1, rank=0)
    journal = {"format": "pdcompile.save-journal", "target": "step-000001", "tokens": ["0a1b2c3d"]}
    (tmp_path / ".step-000001.journal").write_text(json.dumps(journal))  # killed before finish
    (tmp_path / ".step-000001.lease").write_text("{}")  # by a process that is gone
    journal["target"] = "step-000000"  # a name pruned by hand, or by an older pdcompile
    (tmp_path / ".step-000000.journal").write_text(json.dumps(journal))
    (tmp_path / ".step-000000.tmp-0a1b2c3d").mkdir()
    auto.save(saving, 2, rank=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]


def test_a_real_full_disk_is_named_too(tmp_path: Path) -> None:
    """torch's zip writer hides the errno ("unexpected pos ..."): the free space tells."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                             capture_output=True)  # fmt: skip
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr!r}")
    try:
        with pytest.raises(CheckpointError, match=f"the disk holding {disk} is full"):
            checkpoint.save(
                disk / "ckpt", model=torch.nn.Linear(512, 512), optimizer=None, extra={}
            )  # 1 MiB of weights
        assert os.listdir(disk) == []
    finally:
        subprocess.run(["umount", str(disk)], check=True)
