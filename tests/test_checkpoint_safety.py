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

from pdcompile.errors import CheckpointError
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
