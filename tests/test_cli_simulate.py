"""`pdcompile simulate` (summary, Gantt PNG/SVG, Chrome trace, --measured beside a real run),
`pdcompile graph --plan`, the plan table's bottleneck share and `PipelinedModule.save_trace`."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pipeline_support import OPTIMIZERS, mlp_case
from spawn import run_ranks

import pdcompile
from pdcompile.cli.handlers import main
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.text import human_bytes
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.timeline import load_trace
from pdcompile.pictures.gantt import bubble_fraction
from pdcompile.pictures.stage_colours import CROSSING, stage_colour
from pdcompile.runtime.distributed import init_process_group

VGG = Path(__file__).parent / "data" / "pipedream" / "vgg16" / "graph.txt"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def vgg_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """VGG-16 on 4 devices at 1 GB/s: stage 0 on 3 replicas, stage 1 on 1 (dp's answer)."""
    target = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", str(VGG), "--cluster", "4@1GB/s", "--microbatches", "8",
                 "--out", str(target)]) == 0  # fmt: skip
    return target


def test_plan_table_gives_each_stage_its_share_of_the_bottleneck(vgg_plan: Path) -> None:
    plan = Plan.load(vgg_plan)
    lines = str(plan).splitlines()  # the sentence, the header, the table
    assert lines[2].split()[-3:] == ["memory", "of", "bottleneck"]
    worst = max(s.time_s for s in plan.stages)
    for stage, line in zip(plan.stages, lines[3:], strict=False):
        assert line.endswith(f"{stage.time_s / worst:.0%}")
    assert sum(line.endswith(" 100%") for line in lines) == 1


def test_simulate_a_plan_draws_png_and_svg_and_writes_the_trace(capsys, vgg_plan, tmp_path):
    png, svg, trace = tmp_path / "g.png", tmp_path / "g.svg", tmp_path / "t.json"
    code, out, err = run(capsys, "simulate", vgg_plan, "--png", png, "--trace", trace)
    assert code == 0 and f"wrote {png}" in err and f"wrote {trace}" in err
    assert "simulated step:" in out and "1f1b, 8 microbatches on 4@1GB/s" in out
    table = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│")]
    assert [(r.strip(), s.strip()) for r, s, *_ in table] == [
        ("0", "0"), ("1", "0"), ("2", "0"), ("3", "1")
    ]  # fmt: skip
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 20_000

    events = load_trace(trace)
    assert {e.rank for e in events} == {0, 1, 2, 3}
    for kind in ("F", "B"):  # every microbatch once per stage, on one of its replicas
        done = Counter((e.stage, e.microbatch) for e in events if e.kind == kind)
        assert done == Counter({(s, k): 1 for s in (0, 1) for k in range(8)}), kind
    assert all(e.start <= e.end for e in events)
    chrome = json.loads(trace.read_text())  # microseconds, as Perfetto reads them
    complete = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert max(e["ts"] + e["dur"] for e in complete) == pytest.approx(
        max(e.end for e in events) * 1e6
    )

    code, _, _ = run(capsys, "simulate", vgg_plan, "--svg", svg)
    text = svg.read_text()
    assert code == 0 and text.startswith("<?xml") and "<svg" in text
    assert "rank 3 (stage 1)" in text and "simulated: dynprog plan, 1f1b, 8 microbatches" in text


def test_simulate_plans_other_inputs_on_the_fly(capsys, tmp_path) -> None:
    svg = tmp_path / "g.svg"
    code, out, _ = run(capsys, "simulate", VGG, "--cluster", "2@1GB/s", "--schedule", "gpipe",
                       "--microbatches", "4", "--svg", svg)  # fmt: skip
    assert code == 0 and "Plan by dynprog for 2@1GB/s" in out and "gpipe, 4 microbatches" in out
    assert "rank 1 (stage" in svg.read_text()


def test_measured_run_and_its_simulation_side_by_side(capsys, tmp_path) -> None:
    torch.manual_seed(0)
    model, x, y, loss_fn = mlp_case()
    pipe = pdcompile.compile(
        model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"], cluster="2",
        solver="uniform", profile=False, num_microbatches=4,
    )  # fmt: skip
    for _ in range(2):
        pipe.train_step(x, y)
    last, every = tmp_path / "last.json", tmp_path / "all.json"
    pipe.save_trace(last, steps=1)
    pipe.save_trace(every)
    for path, steps in ((last, 1), (every, 2)):
        forwards = Counter(e.rank for e in load_trace(path) if e.kind == "F")
        assert forwards == {0: 4 * steps, 1: 4 * steps}, path
    text = pipe.explain()
    assert "of bottleneck" in text and "send+receive" in text and "rank 1 (stage 1)" in text

    plan, figure = tmp_path / "plan.json", tmp_path / "both.svg"
    pipe.plan.save(plan)
    code, _, err = run(capsys, "simulate", plan, "--measured", last, "--svg", figure)
    assert code == 0, err
    drawn = figure.read_text()
    assert drawn.index(f"measured: {last.name}") < drawn.index("simulated: uniform plan")
    assert drawn.count("rank 0 (stage 0)") == 2


def test_explain_gives_a_rank_of_several_stages_its_bubble_once() -> None:
    torch.manual_seed(0)
    model, x, y, loss_fn = mlp_case()
    pipe = pdcompile.compile(
        model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"], cluster="2",
        schedule="interleaved-1f1b", solver="uniform", profile=False,
    )  # fmt: skip
    for _ in range(2):
        pipe.train_step(x, y)
    workers = pipe.pipeline.workers
    assert sorted(workers) == [(0, 0), (0, 2), (1, 1), (1, 3)]
    lines = pipe.explain().splitlines()
    for rank, stages in ((0, (0, 2)), (1, (1, 3))):
        events = [e for s in stages for e in workers[rank, s].timeline]
        header = next(line for line in lines if line.startswith(f"rank {rank} ("))
        assert header.startswith(
            f"rank {rank} (stages {stages[0]}, {stages[1]}): bubble "
            f"{bubble_fraction(events):.0%} (predicted {pipe.plan.rank_idle[rank]:.0%}), "
            f"peak memory "
        )
        after = lines[lines.index(header) + 1 : lines.index(header) + 3]
        assert [line.split(":")[0] for line in after] == [f"  stage {s}" for s in stages]
        assert all("forward+backward" in line and "bubble" not in line for line in after)
    ranks = [line for line in lines if line.startswith(("rank", "  stage"))]
    assert sum("bubble" in line for line in ranks) == 2  # once per rank


def _save_trace_on_ranks(rank: int, world_size: int, init_file: str, path: str) -> None:
    init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    model, x, y, loss_fn = mlp_case()
    pipe = pdcompile.compile(
        model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"], solver="uniform",
        profile=False, num_microbatches=4,
    )  # fmt: skip
    for _ in range(2):
        pipe.train_step(x, y)
    pipe.save_trace(path, steps=1)  # every rank calls it, rank 0 writes
    dist.destroy_process_group()


def test_save_trace_gathers_every_rank_on_one_clock(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    run_ranks(_save_trace_on_ranks, 2, str(path), timeout_s=180)
    events = load_trace(path)
    forward = {(e.rank, e.microbatch): e for e in events if e.kind == "F"}
    assert sorted(forward) == [(r, k) for r in (0, 1) for k in range(4)]
    for k in range(4):  # one machine, one clock: stage 1 computes k after stage 0 did
        assert forward[1, k].start >= forward[0, k].end


def test_simulate_errors_are_one_line(capsys, vgg_plan, tmp_path) -> None:
    cases = [
        (("simulate", VGG), "is not a Plan JSON: give --cluster"),
        (("simulate", vgg_plan, "--png", tmp_path / "g.svg"), "ending in .png"),
        (("simulate", vgg_plan, "--measured", vgg_plan), "give --png or --svg"),
        (("simulate", vgg_plan, "--measured", vgg_plan, "--png", tmp_path / "g.png"),
         "not a pdcompile timeline trace"),
        # was ignored (the plan's 8 ran), or ran into the schedules' cap unexplained
        (("simulate", vgg_plan, "--microbatches", 0), "an integer >= 1, got int 0"),
        (("simulate", vgg_plan, "--microbatches", 10**9), "above the cap of 65536 microbatches"),
        (("simulate", VGG, "--cluster", "4", "--microbatches", 10**9), "above the cap of 65536"),
        (("simulate", VGG, "--cluster", "99999999999"), "above the cap of 131072"),
    ]  # fmt: skip
    for argv, message in cases:
        code, _, err = run(capsys, *argv)
        assert code == 1 and message in err and err.count("\n") == 1, (argv, err)
    # planning options the plan file fixes are refused, not ignored (exit 2: usage)
    for argv in [("--solver", "uniform"), ("--memory", "1GB")]:
        code, _, err = run(capsys, "simulate", vgg_plan, *argv)
        assert code == 2 and f"{argv[0]} applies only when pdcompile plans here" in err, err
    code, _, _ = run(capsys, "simulate", vgg_plan, "--cluster", "4@1GB/s", "--memory", "1GB")
    assert code == 0  # with --cluster, --memory belongs to the cluster it simulates on


def test_graph_plan_colours_stages_and_labels_crossing_edges(capsys, vgg_plan, tmp_path):
    plan_file = tmp_path / "mlp.json"
    run(capsys, "plan", "pdcompile.zoo:mlp", "--analytic", "--cluster", "2", "--solver",
        "uniform", "--out", plan_file)  # fmt: skip
    plan = Plan.load(plan_file)
    code, out, _ = run(capsys, "graph", "pdcompile.zoo:mlp", "--plan", plan_file, "--format", "dot")
    assert code == 0
    for stage in plan.stages:
        for node in stage.nodes:
            line = next(x for x in out.splitlines() if x.startswith(f'  "{node}" ['))
            assert f'stage {stage.index}", ' in line and stage_colour(stage.index) in line
    last, first = plan.stages[0].nodes[-1], plan.stages[1].nodes[0]  # a chain: one crossing
    crossing = [x for x in out.splitlines() if CROSSING in x]
    assert crossing == [f'  "{last}" -> "{first}" [label="[4, 64]\\n1.0 KiB", {CROSSING}];']

    code, out, _ = run(capsys, "graph", VGG, "--plan", vgg_plan, "--format", "dot")
    stage = Plan.load(vgg_plan).stage_of
    costs = CostGraph.from_pipedream(VGG)
    cut = {(u, v, d["bytes"]) for u, v, d in costs.graph.edges(data=True) if stage[u] != stage[v]}
    assert code == 0 and len(cut) == 1 and f'fillcolor="{stage_colour(1)}"' in out
    assert [x for x in out.splitlines() if CROSSING in x] == [
        f'  "{u}" -> "{v}" [label="{human_bytes(b)}", {CROSSING}];' for u, v, b in cut
    ]

    code, _, err = run(capsys, "graph", VGG, "--plan", plan_file, "--format", "dot")
    assert code == 1 and "does not have: x, net_0" in err and err.count("\n") == 1
    code, _, err = run(capsys, "graph", VGG, "--plan", plan_file)
    assert code == 1 and "add --format dot, svg or png" in err
