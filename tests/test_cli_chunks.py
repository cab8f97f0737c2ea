"""`--chunks N` (stages per rank) on `pdcompile plan`, `simulate`, `codegen` and `bench-solvers`,
and the tables that then list several stages per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pdcompile
from pdcompile import Plan
from pdcompile.cli.bench_instances import synthetic_chain
from pdcompile.cli.handlers import main
from pdcompile.core.text import human_bytes


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str) -> list[list[str]]:
    """The cells of a rich table's rows in the output."""
    return [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines()
            if line.startswith("│")]  # fmt: skip


@pytest.fixture(scope="module")
def costs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A chain of 8 layers with random costs, as a CostGraph JSON."""
    path = tmp_path_factory.mktemp("costs") / "chain.json"
    synthetic_chain(8).save(path)
    return path


def test_plan_chunks_places_that_many_stages_on_each_rank(capsys, costs, tmp_path) -> None:
    target = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", costs, "--cluster", "2", "--schedule", "zb-h1",
                         "--chunks", "3", "--out", target)  # fmt: skip
    assert code == 0, err
    plan = Plan.load(target)
    assert [s.ranks for s in plan.stages] == [(0,), (1,)] * 3
    assert plan == pdcompile.plan(pdcompile.CostGraph.load(costs), "2", schedule="zb-h1",
                                  chunks=3).with_(solve_time_s=plan.solve_time_s)  # fmt: skip
    # the stage table, then once per rank its stages, simulated peak memory and idle share
    notes = [line for line in out.splitlines() if line.startswith("rank ")]
    assert notes == [
        f"rank {r} runs stages {stages}: peak memory {human_bytes(plan.rank_memory[r])}, "
        f"idle {plan.rank_idle[r]:.1%} of the step"
        for r, stages in enumerate(["0, 2, 4", "1, 3, 5"])
    ]


def test_plan_table_has_no_rank_notes_with_one_stage_per_rank(capsys, costs) -> None:
    code, out, _ = run(capsys, "plan", costs, "--cluster", "2", "--schedule", "interleaved-1f1b",
                       "--chunks", "1")  # fmt: skip
    assert code == 0 and "schedule interleaved-1f1b" in out
    assert not [line for line in out.splitlines() if line.startswith("rank ")]


def test_simulate_lists_every_stage_of_a_rank_and_its_bubble_once(capsys, costs) -> None:
    code, out, err = run(capsys, "simulate", costs, "--cluster", "2", "--schedule",
                         "interleaved-1f1b", "--chunks", "2")  # fmt: skip
    assert code == 0, err
    plan = pdcompile.plan(pdcompile.CostGraph.load(costs), "2", schedule="interleaved-1f1b")
    sim = pdcompile.simulate(plan)
    assert "┃ rank ┃ stages ┃ bubble ┃ peak memory ┃" in out
    assert rows(out) == [
        [str(r), stages, f"{sim.bubble_fraction[r]:.1%}", human_bytes(sim.peak_memory[r])]
        for r, stages in enumerate(["0, 2", "1, 3"])
    ]


def test_codegen_chunks_writes_a_module_per_stage(capsys, tmp_path) -> None:
    out_dir = tmp_path / "program"
    code, out, err = run(capsys, "codegen", "pdcompile.zoo:mlp", "--cluster", "2", "--schedule",
                         "zb-h1", "--chunks", "2", "--out", out_dir)  # fmt: skip
    assert code == 0, err
    assert "rank 0 runs stages 0, 2" in out and "rank 1 runs stages 1, 3" in out
    assert sorted(p.name for p in out_dir.glob("stage_*.py")) == [f"stage_{i}.py" for i in range(4)]


def test_bench_solvers_plans_each_solver_with_the_chunks(capsys, tmp_path) -> None:
    out_json = tmp_path / "bench.json"
    code, out, err = run(capsys, "bench-solvers", "chain:8", "--cluster", "2", "--schedule",
                         "zb-h1", "--chunks", "2", "--solvers", "dynprog,uniform", "--time-limit",
                         "0", "--json", out_json)  # fmt: skip
    assert code == 0, err
    data = json.loads(out_json.read_text())
    assert data["settings"]["chunks"] == 2
    assert [(r["solver"], r["status"], r["num_stages"], r["num_devices_used"])
            for r in data["results"]] == [("dynprog", "ok", 4, 2),
                                          ("uniform", "ok", 4, 2)]  # fmt: skip
    assert {(row[0], row[5], row[6]) for row in rows(out)} == {("dynprog", "4", "2"),
                                                              ("uniform", "4", "2")}  # fmt: skip


BAD = [
    (("--schedule", "zb-h1", "--chunks", "0"), "chunks must be an integer >= 1"),
    (("--schedule", "zb-h1", "--chunks", "-2"), "chunks must be an integer >= 1"),
    (("--schedule", "zb-h2", "--chunks", "2"), "zb-h2 runs one stage per rank"),
    (("--schedule", "zb-v", "--chunks", "3"), "zb-v runs two stages per rank (chunks=2), got 3"),
]


@pytest.mark.parametrize("options, message", BAD)
@pytest.mark.parametrize("command", ["plan", "simulate", "bench-solvers", "codegen"])
def test_bad_chunks_are_one_line_errors(capsys, costs, command, options, message) -> None:
    spec = "pdcompile.zoo:mlp" if command == "codegen" else costs
    extra = ("--out", "unused") if command == "codegen" else ()
    code, out, err = run(capsys, command, spec, "--cluster", "2", *options, *extra)
    assert code == 1 and message in err and err.count("\n") == 1, err
    assert err.startswith("pdcompile: error: ")


@pytest.mark.parametrize("command", ["plan", "bench-solvers"])
def test_auto_chooses_its_own_chunks(capsys, costs, command) -> None:
    schedule = "--schedule" if command == "plan" else "--schedules"
    code, _, err = run(capsys, command, costs, "--cluster", "2", schedule, "auto", "--chunks", "2")
    assert code == 1 and "chooses the chunks per rank itself" in err and err.count("\n") == 1


def test_a_plan_file_fixes_the_chunks(capsys, costs, tmp_path) -> None:
    target = tmp_path / "plan.json"
    assert run(capsys, "plan", costs, "--cluster", "2", "--out", target)[0] == 0
    code, _, err = run(capsys, "simulate", target, "--chunks", "2")
    assert code == 2 and "--chunks applies only when pdcompile plans here" in err
    code, _, err = run(capsys, "codegen", "pdcompile.zoo:mlp", "--plan", target, "--chunks", "2",
                       "--out", tmp_path / "program")  # fmt: skip
    assert code == 2 and "--chunks applies only when pdcompile plans here" in err
