"""Checkpoints against hostile files and names: nothing hangs, no other checkpoint is touched.

- Files that are not regular (a FIFO, a folder, a symlink to a FIFO, a device) in place of the
  manifest, DCP's metadata, a shard or the checkpoint folder itself, the manifest edited to
  match: every loader refuses them with a `CheckpointError` naming the file, without opening
  them (a FIFO would block, /dev/zero never ends); a save refuses a journal that is not a file.
- Huge and nested: a manifest past the size cap, names past the filesystem's limit, a
  checkpoint saved inside another's folder.
- Name collisions (hypothesis): checkpoints with adversarial names in one folder (`run.old-best`,
  `.run.tmp-x`, dots and dashes) saved, some saves killed at a random point, and loaded in a
  random order: a save changes its own checkpoint and leftovers only, a load returns the last
  complete save or refuses naming the folder, and clean saves leave nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.core.errors import CheckpointError
from pdcompile.runtime import checkpoint, manifest

LOADERS: dict[str, Callable[[Path], object]] = {
    "load": lambda d: checkpoint.load(d, model=torch.nn.Linear(2, 2)),
    "load_full_state_dict": checkpoint.load_full_state_dict,
}
KINDS = {  # how to put something that is not a regular file at a path, and what it is then
    "fifo": (lambda path, spare: os.mkfifo(path), "a FIFO"),
    "folder": (lambda path, spare: os.mkdir(path), "a folder"),
    "symlink to a fifo": (
        lambda path, spare: (os.mkfifo(spare), os.symlink(spare, path)),
        "a FIFO",
    ),
    "device": (lambda path, spare: os.symlink("/dev/zero", path), "a character device"),
}


class _Killed(BaseException):
    """Ends a save where a SIGKILL would: nothing of the save's own cleanup runs."""


def _save(directory: Path, value: float) -> None:
    module = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(module.weight, value)
    checkpoint.save(directory, model=module, optimizer=None, extra={}, step=int(value))


def _weight(directory: Path) -> float:
    return checkpoint.load_full_state_dict(directory)["weight"][0, 0].item()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    _save(directory, 1)
    return directory


# files that are not regular -------------------------------------------------------------------


@pytest.mark.timeout(60)  # a FIFO or /dev/zero opened would block until then
@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("name", ["manifest.json", ".metadata", "__0_0.distcp"])
def test_a_file_that_is_not_regular_is_refused_unopened(
    saved: Path, tmp_path: Path, name: str, kind: str, loader: str
) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(saved, directory)
    (directory / name).unlink()
    make, what = KINDS[kind]
    make(directory / name, tmp_path / "spare")
    if name != "manifest.json":  # the manifest edited to match what is there now
        doc = json.loads((directory / "manifest.json").read_text())
        size = os.stat(directory / name).st_size
        doc["files"][name] = {"bytes": size, "sha256": hashlib.sha256(b"").hexdigest()}
        (directory / "manifest.json").write_text(json.dumps(doc))
    fix = "the folder was altered[,:] load an earlier checkpoint"
    with pytest.raises(CheckpointError, match=rf"{name} is {what}, not a regular file.*{fix}"):
        LOADERS[loader](directory)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_checkpoint_path_or_journal_that_is_not_regular_is_refused(
    tmp_path: Path, kind: str
) -> None:
    make, what = KINDS[kind]
    if kind != "folder":
        make(tmp_path / "ckpt", tmp_path / "spare")
        for load in LOADERS.values():
            with pytest.raises(CheckpointError, match=f"ckpt: not a checkpoint: it is {what}, no"):
                load(tmp_path / "ckpt")
        with pytest.raises(CheckpointError, match=f"ckpt is {what}, not a checkpoint folder"):
            _save(tmp_path / "ckpt", 1)
    make(tmp_path / ".run.journal", tmp_path / "spare2")
    with pytest.raises(CheckpointError, match=rf"\.run\.journal, where saves into run record what "
                       f"they create, is {what}: move it away"):  # fmt: skip
        _save(tmp_path / "run", 1)
    with pytest.raises(CheckpointError, match="run: not a checkpoint: no such folder"):
        checkpoint.load_full_state_dict(tmp_path / "run")  # the journal is not opened
    assert not (tmp_path / "run").exists()


# huge and nested ------------------------------------------------------------------------------


def test_a_huge_manifest_is_refused_unread(saved: Path, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(saved, directory)
    os.truncate(directory / "manifest.json", (64 << 20) + 1)  # sparse: no disk written
    with pytest.raises(CheckpointError, match=r"manifest.json is over 67108864 bytes.*altered"):
        checkpoint.load_full_state_dict(directory)


def test_huge_names_nested_folders_and_a_huge_journal(tmp_path: Path) -> None:
    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    with pytest.raises(CheckpointError, match=f"is {longest - 13} bytes: .* choose a shorter"):
        _save(tmp_path / ("n" * (longest - 13)), 1)
    _save(tmp_path / ("n" * (longest - 14)), 2)  # its staging folder's name just fits
    assert _weight(tmp_path / ("n" * (longest - 14))) == 2

    _save(tmp_path / "a" / "b" / "run", 3)  # parents created
    _save(tmp_path / "a" / "b" / "run" / "inner", 4)  # inside another checkpoint's folder
    with pytest.raises(CheckpointError, match=r"inner is in the folder but not in manifest"):
        checkpoint.load_full_state_dict(tmp_path / "a" / "b" / "run")
    with pytest.raises(CheckpointError, match=r"run holds \['inner'\], which are not a check"):
        _save(tmp_path / "a" / "b" / "run", 5)
    assert _weight(tmp_path / "a" / "b" / "run" / "inner") == 4

    journal = tmp_path / "a" / ".big.journal"
    journal.write_bytes(b"[" * (1 << 20))  # unreadable: it records nothing, nothing is deleted
    (tmp_path / "a" / ".big.tmp-0123abcd").mkdir()
    _save(tmp_path / "a" / "big", 6)
    assert _weight(tmp_path / "a" / "big") == 6
    assert (tmp_path / "a" / ".big.tmp-0123abcd").is_dir() and not journal.exists()


def test_a_checkpoint_named_like_a_journal_is_not_confused_with_it(tmp_path: Path) -> None:
    _save(tmp_path / ".run.journal", 1)  # a checkpoint where saves into `run` keep their journal
    with pytest.raises(CheckpointError, match=r"\.run\.journal, where saves into run .* folder"):
        _save(tmp_path / "run", 2)
    assert _weight(tmp_path / ".run.journal") == 1 and not (tmp_path / "run").exists()


# name collisions ------------------------------------------------------------------------------

GROUPS = [  # names in one folder: prefixes of each other's leftovers, dots and dashes
    ["run", "run.old-best", "run.tmp-0", ".run.tmp-x"],
    ["run", "run.old-", "run.old-best", "run.old-best.old-x"],
    [".run", "run.", "run-2", "a.b-c.d"],
]
POINTS = ["writing", "hashing", "renaming", "deleting", None]


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, str, str | None]]:
    """A save into every name of a group (some killed at a point: leftovers beside each other),
    then more saves and loads, in a random order."""
    names = draw(st.sampled_from(GROUPS))
    op = st.tuples(st.sampled_from(["save", "load"]), st.sampled_from(names),
                   st.sampled_from(POINTS))  # fmt: skip
    first = [("save", name, draw(st.sampled_from(POINTS))) for name in names]
    return draw(st.permutations(first)) + draw(st.lists(op, min_size=1, max_size=4))


def _owned(name: str, entry: str) -> bool:
    """Whether a save into `name` may change `entry`: its folder, journal, lease, leftovers."""
    prefix = re.escape(f".{name}.")
    return entry in (name, f".{name}.journal", f".{name}.lease") or bool(
        re.fullmatch(prefix + r"(tmp|old)-[0-9a-f]{8}", entry)
    )


def _snapshot(folder: Path) -> dict[str, dict[str, bytes]]:
    """Each entry of `folder`: the contents of its files (its own, for a file)."""
    found = {}
    for entry in folder.iterdir():
        files = [entry] if entry.is_file() else sorted(p for p in entry.rglob("*") if p.is_file())
        found[entry.name] = {str(p.relative_to(folder)): p.read_bytes() for p in files}
    return found


def _killing(point: str | None, name: str, patch: pytest.MonkeyPatch) -> None:
    """Make the next save end at `point` as a killed process would (None: it completes)."""
    if point == "writing":  # DCP syncs each data file once written: the first one (DCP
        # reports the failure as its own: the save raises CheckpointError)
        patch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(_Killed()))
    elif point == "hashing":  # every file written, the manifest not yet
        patch.setattr(manifest, "sha256", lambda path: (_ for _ in ()).throw(_Killed()))
    elif point == "renaming":  # the previous checkpoint renamed aside, the new one not in place
        rename = os.rename

        def renamed(source: str, target: str) -> None:
            if os.path.basename(source).startswith(f".{name}.tmp-"):
                raise _Killed
            rename(source, target)

        patch.setattr(os, "rename", renamed)
    elif point == "deleting":  # the first folder a save deletes
        patch.setattr(shutil, "rmtree", lambda *a, **k: (_ for _ in ()).throw(_Killed()))


@pytest.mark.timeout(240)
@settings(
    max_examples=50,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI failures reproduce
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=operations())
def test_saves_and_loads_under_colliding_names(ops: list, monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        values: dict[str, set[float]] = {}  # what a load of each name may return
        for step, (op, name, point) in enumerate(ops, start=1):
            before = _snapshot(folder)
            if op == "save":
                with monkeypatch.context() as patch:
                    _killing(point, name, patch)
                    try:
                        _save(folder / name, step)
                        values[name] = {step}
                    except (_Killed, CheckpointError) as exc:
                        assert point is not None, exc
                        assert isinstance(exc, _Killed) or str(folder / name) in str(exc), exc
                        values[name] = values.get(name, set()) | {step}
            else:
                try:
                    assert _weight(folder / name) in values.get(name, set()), (name, ops)
                except CheckpointError as exc:
                    assert str(folder / name) in str(exc), exc
            after = _snapshot(folder)
            for entry, files in before.items():
                if not _owned(name, entry):
                    assert after.get(entry) == files, (entry, op, name, point, ops)
        for name in sorted(values):  # clean saves: nothing is left beside the checkpoints
            _save(folder / name, 0)
        assert sorted(p.name for p in folder.iterdir()) == sorted(values), ops
