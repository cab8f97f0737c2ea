"""Checkpoints are never lost or silently corrupted (runtime/checkpoint.py, runtime/manifest.py).

A save lands whole or not at all: it is checked here by killing a saving process (SIGKILL) at
each step of a save. A load verifies `manifest.json` and every checksum before DCP opens a file
(its metadata is a pickle): flipped bytes, deleted, added or truncated files are refused with an
error naming the file. Also the loopback default of the rendezvous.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawn import free_port, run_ranks
from torch.distributed.checkpoint import FileSystemReader

from pdcompile.core.errors import CheckpointError
from pdcompile.runtime import checkpoint, checkpoint_reader, manifest
from pdcompile.runtime.distributed import init_process_group
from pdcompile.zoo import MLP


def model(seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP(p=0.0)


def save(directory: Path, seed: int = 0, step: int = 1) -> dict[str, torch.Tensor]:
    """Save a seeded MLP with an Adam state; return its state dict."""
    module = model(seed)
    adam = torch.optim.Adam(module.parameters())
    module(torch.randn(4, 32)).sum().backward()
    adam.step()
    checkpoint.save(directory, model=module, optimizer=adam, extra={"seed": seed}, step=step)
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_holds(directory: Path, state: dict[str, torch.Tensor]) -> None:
    loaded = checkpoint.load_full_state_dict(directory)
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name


def siblings(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.parent.iterdir())


@pytest.fixture
def unopened(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if DCP's (pickled) metadata is read: integrity errors must come first."""

    def read_metadata(*args: object, **kwargs: object) -> None:
        raise AssertionError("DCP metadata was opened before the checkpoint verified")

    monkeypatch.setattr(FileSystemReader, "read_metadata", read_metadata)
    monkeypatch.setattr(checkpoint_reader.Reader, "read_metadata", read_metadata)
    monkeypatch.setattr(checkpoint, "read_metadata", read_metadata)


# round trips ----------------------------------------------------------------------------------


def test_manifest_records_files_step_and_contents(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    state = save(directory, step=7)
    found = manifest.read(str(directory))
    files = sorted(p.name for p in directory.iterdir() if p.name != "manifest.json")
    assert sorted(found.files) == files == [".metadata", "__0_0.distcp"]
    for name, (size, digest) in found.files.items():
        assert size == (directory / name).stat().st_size
        assert digest == manifest.sha256(str(directory / name))
    assert (found.step, found.world_size, found.optimizer) == (7, 1, True)
    assert found.model == tuple(sorted(state)) and found.extra == ("seed",)
    assert json.loads((directory / "manifest.json").read_text())["format"] == manifest.FORMAT

    fresh = model(5)
    adam = torch.optim.Adam(fresh.parameters())
    assert checkpoint.load(directory, model=fresh, optimizer=adam) == {"seed": 0}
    assert len(adam.state) == len(list(fresh.parameters()))
    assert_holds(directory, state)
    assert siblings(directory) == ["ckpt"]  # no staging folder left


def test_a_save_replaces_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    save(directory, seed=0)
    (directory / "__1_0.distcp").write_bytes(b"a file of a wider save")  # replaced too
    manifest.write(str(directory), manifest.describe(str(directory), 2, {}))
    state = save(directory, seed=1, step=2)
    assert_holds(directory, state)
    assert not (directory / "__1_0.distcp").exists()
    assert manifest.read(str(directory)).step == 2
    assert siblings(directory) == ["ckpt"]


def test_a_folder_with_other_files_is_not_replaced(tmp_path: Path) -> None:
    directory = tmp_path / "results"
    directory.mkdir()
    (directory / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"results holds \['notes.txt'\].*new folder"):
        save(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["notes.txt"]
    assert siblings(directory) == ["results"]


# verification before opening ------------------------------------------------------------------

LOADERS = {
    "load": lambda d: checkpoint.load(d, model=model(3)),
    "load_full_state_dict": checkpoint.load_full_state_dict,
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_a_flipped_byte_is_refused_naming_the_file(
    tmp_path: Path, name: str, loader: str, unopened: None
) -> None:
    save(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"rank 0: {name} does not match its SHA-256"):
        LOADERS[loader](tmp_path / "ckpt")


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_missing_added_and_truncated_files_are_refused(
    tmp_path: Path, loader: str, unopened: None
) -> None:
    load = LOADERS[loader]
    directory = tmp_path / "ckpt"
    save(directory)
    data = (directory / "__0_0.distcp").read_bytes()

    (directory / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match="__0_0.distcp, which manifest.json lists, cannot"):
        load(directory)
    (directory / "__0_0.distcp").write_bytes(data[:-1])
    with pytest.raises(CheckpointError, match=f"__0_0.distcp is {len(data) - 1} bytes but"):
        load(directory)
    (directory / "__0_0.distcp").write_bytes(data)
    (directory / "__1_0.distcp").write_bytes(data)
    with pytest.raises(CheckpointError, match="__1_0.distcp is in the folder but not in manif"):
        load(directory)
    (directory / "__1_0.distcp").unlink()

    text = (directory / "manifest.json").read_text()
    (directory / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"ckpt: manifest.json is not valid JSON"):
        load(directory)
    (directory / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="a torch.distributed.checkpoint directory without"):
        load(directory)


def test_a_manifest_naming_files_outside_the_folder_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    save(directory)
    doc = json.loads((directory / "manifest.json").read_text())
    doc["files"]["../secret"] = {"bytes": 1, "sha256": "0" * 64}
    (directory / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"lists '../secret', not a file name inside"):
        checkpoint.load_full_state_dict(directory)


def _corrupt_on_two(rank: int, world_size: int, init_file: str, root: str) -> dict:
    """Save on 2 ranks; rank 0 flips a byte of rank 1's data file; both ranks load."""
    init_process_group(rank, world_size, init_file=init_file, backend="gloo", timeout_s=60)
    directory = os.path.join(root, "two")
    stage = torch.nn.Linear(4, 4) if rank == 0 else torch.nn.Linear(4, 2)
    prefix = torch.nn.ModuleDict({f"stage{rank}": stage})
    checkpoint.save(directory, model=prefix, optimizer=None, extra={}, step=3)
    files = sorted(manifest.read(directory).files)
    loaded = checkpoint.load(directory, model=prefix)
    dist.barrier()
    if rank == 0:
        path = os.path.join(directory, "__1_0.distcp")
        data = bytearray(open(path, "rb").read())
        data[-1] ^= 0x80
        open(path, "wb").write(bytes(data))
    dist.barrier()
    try:
        checkpoint.load(directory, model=prefix)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    dist.destroy_process_group()
    return {"files": files, "loaded": loaded, "error": error}


def test_every_rank_refuses_a_file_that_one_rank_verifies(tmp_path: Path) -> None:
    ranks = run_ranks(_corrupt_on_two, 2, str(tmp_path), timeout_s=90)
    assert ranks[0]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert all(r["loaded"] == {} for r in ranks)
    # the ranks hash the sorted files round robin: rank 0 checks .metadata and __1_0.distcp
    for out in ranks:
        assert "rank 0: __1_0.distcp does not match its SHA-256" in out["error"], out["error"]


# a save killed in the middle ------------------------------------------------------------------

_CHILD = r"""
import os, shutil, sys, time
import torch
from pdcompile.runtime import checkpoint, checkpoint_reader, manifest
from pdcompile.zoo import MLP

directory, marker, point = sys.argv[1:]
torch.set_num_threads(1)


def stop(*args, **kwargs):
    open(marker, "w").close()
    time.sleep(600)  # killed here


if point == "writing":  # DCP syncs each data file once written: stop at the first
    os.fsync = stop
elif point == "hashing":  # every file written, the manifest not yet
    manifest.sha256 = stop
elif point == "renaming":  # the previous checkpoint renamed aside, the new one not in place
    rename = os.rename
    staging = lambda path: os.path.basename(path).startswith(".ckpt.tmp-")
    os.rename = lambda a, b: stop() if staging(a) else rename(a, b)
elif point == "deleting":  # the new one in place, the previous one not yet deleted
    shutil.rmtree = stop
torch.manual_seed(1)
checkpoint.save(directory, model=MLP(p=0.0), optimizer=None, extra={}, step=2)
"""


def kill_while_saving(directory: Path, point: str) -> None:
    """Run a save of seed 1's MLP in a child process and SIGKILL it at `point`."""
    marker = directory.parent / "stopped"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory), str(marker), point],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            if child.poll() is not None:
                pytest.fail(f"the saving child exited before {point}: {child.stderr.read()}")
            if time.monotonic() > deadline:
                pytest.fail(f"the saving child did not reach {point} within 120 s")
            time.sleep(0.05)
    finally:
        child.kill()  # SIGKILL: no cleanup runs
        child.wait(timeout=30)
        child.stderr.close()


@pytest.mark.parametrize("point", ["writing", "hashing"])
def test_a_save_killed_before_its_rename_leaves_the_previous_checkpoint(
    tmp_path: Path, point: str
) -> None:
    directory = tmp_path / "ckpt"
    previous = save(directory)
    kill_while_saving(directory, point)
    assert_holds(directory, previous)
    assert checkpoint.load(directory, model=model(3)) == {"seed": 0}
    assert [n for n in siblings(directory) if ".tmp-" in n]  # what the killed save left
    state = save(directory, seed=2)  # the next save clears it
    assert_holds(directory, state)
    assert siblings(directory) == ["ckpt", "stopped"]


def test_a_save_killed_between_its_renames_says_where_the_previous_one_is(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "ckpt"
    previous = save(directory)
    kill_while_saving(directory, "renaming")
    assert not directory.exists()
    with pytest.raises(CheckpointError, match="a save was killed while replacing it") as info:
        checkpoint.load_full_state_dict(directory)
    (old,) = [tmp_path / n for n in siblings(directory) if ".old-" in n]
    assert f"rename {old} to {directory} to load the previous one" in str(info.value)
    old.rename(directory)  # as the message says
    assert_holds(directory, previous)

    directory.rename(tmp_path / f".ckpt.old-{'0' * 8}")  # as the killed save left it
    state = save(directory, seed=2)  # the next save restores it first, then replaces it
    assert_holds(directory, state)
    assert siblings(directory) == ["ckpt", "stopped"]


def test_a_save_killed_after_its_rename_leaves_the_new_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    save(directory)
    kill_while_saving(directory, "deleting")
    assert_holds(directory, model(1).state_dict())
    assert manifest.read(str(directory)).step == 2
    assert [n for n in siblings(directory) if ".old-" in n]
    save(directory, seed=2)
    assert siblings(directory) == ["ckpt", "stopped"]


# the rendezvous -------------------------------------------------------------------------------


def _listening(port: int) -> list[str]:
    """Local addresses listening on `port` (Linux's /proc/net/tcp, tcp6), as hex."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and local.endswith(f":{port:04X}"):
                found.append(local.rsplit(":", 1)[0])
    return found


def _meet_without_address(rank: int, world_size: int, init_file: str, port: int) -> dict:
    os.environ.pop("MASTER_ADDR", None)
    os.environ["MASTER_PORT"] = str(port)
    init_process_group(rank, world_size, timeout_s=60)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    listening = _listening(port) if rank == 0 else []
    dist.destroy_process_group()
    return {"total": total.item(), "listening": listening}


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket table")
def test_without_an_address_the_rendezvous_listens_on_loopback_only() -> None:
    ranks = run_ranks(_meet_without_address, 2, free_port(), timeout_s=90)
    assert [r["total"] for r in ranks] == [3.0, 3.0]
    assert ranks[0]["listening"] == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or ::
