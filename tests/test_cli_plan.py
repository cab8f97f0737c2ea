"""`pdcompile plan`, `pdcompile solvers` and `pdcompile compare`."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcompile import Plan
from pdcompile.cli.handlers import main

VGG = Path(__file__).parent / "data" / "pipedream" / "vgg16" / "graph.txt"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_the_stage_table_and_writes_the_plan(capsys, tmp_path) -> None:
    target = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", str(VGG), "--cluster", "4@10GB/s,4@1.25GB/s",
                         "--schedule", "pipedream", "--out", str(target))  # fmt: skip
    assert code == 0 and f"wrote {target}" in err
    assert "Plan by dynprog for 4@10GB/s,4@1.25GB/s (16 devices), schedule pipedream" in out
    assert "speed-up over data parallelism" in out
    plan = Plan.load(target)
    assert plan.solver == "dynprog" and plan.num_devices_used <= 16 and plan.schedule == "pipedream"


def test_plan_of_a_model_spec(capsys) -> None:
    code, out, _ = run(capsys, "plan", "pdcompile.zoo:mlp", "--cluster", "2", "--analytic",
                       "--solver", "blocks", "--microbatches", "4")  # fmt: skip
    assert code == 0 and "Plan by blocks" in out and "4 microbatches" in out


def test_solvers_lists_the_registry(capsys) -> None:
    code, out, _ = run(capsys, "solvers")
    assert code == 0
    names = [line.split()[0] for line in out.splitlines()]
    assert {"dynprog", "dp", "uniform", "params", "blocks"} <= set(names)


def test_compare_ranks_every_solver_under_evaluate(capsys) -> None:
    code, out, _ = run(capsys, "compare", str(VGG), "--cluster", "8@3.125GB/s")
    assert code == 0 and "under evaluate" in out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    by_solver = {r.split("│")[1].strip(): r.split("│")[3].strip() for r in rows}
    assert by_solver["dynprog"] == "1.000"  # dynprog is (one of) the best
    assert {r.split("│")[1].strip() for r in rows} >= {"dynprog", "uniform", "params", "blocks"}


def test_plan_errors_are_one_line(capsys) -> None:
    code, _, err = run(capsys, "plan", str(VGG), "--cluster", "4@0GB/s")
    assert code == 1 and "positive number of bytes/s" in err and err.count("\n") == 1
    code, _, err = run(capsys, "plan", str(VGG), "--cluster", "4", "--solver", "magic")
    assert code == 1 and "unknown solver 'magic'" in err
    code, _, err = run(capsys, "plan", str(VGG), "--cluster", "4", "--memory", "1MB")
    # recomputing included (plan()'s default): the least memory a plan needs, one line
    assert code == 1 and "no plan fits" in err and err.count("\n") == 1


def test_plan_recomputes_under_a_memory_limit_unless_told_not_to(capsys) -> None:
    spec = ("plan", "pdcompile.zoo:gpt", "--cluster", "2", "--analytic", "--memory")
    code, out, _ = run(capsys, *spec, "1.8MB")  # auto: the stages that need it
    assert code == 0 and "activation recomputation: stage 0 in segments after" in out
    assert "predicted +" in out and "stage 1" not in out.split("activation recomputation")[1]
    code, out, _ = run(capsys, *spec, "1.8MB", "--recompute", "on")
    assert code == 0 and "stage 0 in segments after" in out and ", stage 1 " in out
    code, _, err = run(capsys, *spec, "1.8MB", "--recompute", "off")
    assert code == 1 and "fits" in err and err.count("\n") == 1
