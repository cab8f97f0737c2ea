"""Loaders refuse a path that is not a regular file, never opening it to block (issue 31): a FIFO
given as a plan, costs, PipeDream profile, trace, torch schedule CSV or written program is a named
error at once; one standing where a profile, calibration or optimizer-step cache file belongs is
ignored (the cache measures again)."""

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


def test_a_fifo_as_a_torch_schedule_csv_or_a_written_program_is_a_named_error(
    fifo: str, tmp_path: Path
) -> None:
    from pdcompile.core.errors import CodegenError
    from pdcompile.lowering.staged_program import StagedProgram
    from pdcompile.scheduling.torch_csv import from_torch_csv

    with pytest.raises(ScheduleError, match="a FIFO, not a regular file"):
        from_torch_csv(fifo)
    folder = tmp_path / "program"
    folder.mkdir()
    os.mkfifo(folder / "program.json")
    with pytest.raises(CodegenError, match=r"program\.json: it is a FIFO, not a regular file"):
        StagedProgram.load(folder, torch.nn.Linear(2, 2))


def test_a_fifo_in_place_of_the_optimizer_step_cache_is_ignored(tmp_path: Path) -> None:
    from pdcompile.passes import step_costs

    path = tmp_path / "optimizer-0123.json"
    os.mkfifo(path)
    assert step_costs._read(path) == {"steps": {}, "adds": {}}


def test_the_command_line_names_a_fifo_as_one_not_as_a_missing_file(tmp_path: Path, capsys) -> None:
    costs, module = tmp_path / "costs.json", tmp_path / "model.py"
    os.mkfifo(costs)
    os.mkfifo(module)
    commands = [
        ["plan", str(costs), "--cluster", "2"],
        ["bench-solvers", str(costs), "--cluster", "2"],
        ["plan", f"{module}:make", "--cluster", "2"],
        ["bench-solvers", "docs/pictures/chain8.json", "--cluster", "2", "--plugin", str(module)],
    ]
    for command in commands:
        assert main(command) != 0, command
        err = capsys.readouterr().err
        assert "it is a FIFO, not a regular file" in err and "no such file" not in err, err
