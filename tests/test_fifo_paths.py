"""Loaders refuse a path that is not a regular file, never opening it to block (issue 31): a FIFO
given as a plan, costs, PipeDream profile or trace is a named error at once; one standing where a
profile or calibration cache file belongs is ignored (the cache measures again)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pdcompile import CostGraph, Plan
from pdcompile.cli.handlers import main
from pdcompile.core.errors import CostError, PartitionError, ScheduleError
from pdcompile.passes import framework_cost, profile_cache
from pdcompile.passes.planning.timeline import load_trace

pytestmark = pytest.mark.timeout(30)  # the old loaders blocked in open() forever


@pytest.fixture
def fifo(tmp_path: Path) -> str:
    path = tmp_path / "named.json"
    os.mkfifo(path)
    return str(path)


@pytest.mark.parametrize(
    ("load", "error"),
    [
        (Plan.load, PartitionError),
        (CostGraph.load, CostError),
        (CostGraph.from_pipedream, CostError),
        (load_trace, ScheduleError),
    ],
)
def test_a_fifo_is_a_named_error_not_a_hang(fifo: str, load, error: type) -> None:
    with pytest.raises(error, match=rf"{fifo}.*a FIFO, not a regular file"):
        load(fifo)
    with pytest.raises(error, match="a folder, not a regular file"):
        load(os.path.dirname(fifo))


def test_plan_measured_refuses_a_fifo_trace(fifo: str, capsys) -> None:
    code = main(["plan", "docs/pictures/chain8.json", "--cluster", "2", "--measured", fifo])
    assert code != 0 and "a FIFO, not a regular file" in capsys.readouterr().err


def test_a_fifo_in_place_of_a_cache_file_is_ignored(tmp_path: Path) -> None:
    key = "0123456789abcdef0123456789abcdef"
    os.mkfifo(profile_cache.cache_file(tmp_path, key))
    assert profile_cache.read_cache(profile_cache.cache_file(tmp_path, key), key,
                                    lambda t, s: True) is None  # fmt: skip
    os.mkfifo(framework_cost.cache_file(tmp_path, framework_cost.cache_key(
        torch.device("cpu"), 1)))  # fmt: skip
    assert framework_cost.read_cached("cpu", 1, cache=tmp_path) is None
