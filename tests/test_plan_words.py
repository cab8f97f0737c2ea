"""The plan in plain words and numbers a user can trust (issue 30, items 6 and 7): the sentence
`str(plan)` and `explain()` open with, one step prediction in every text, `rescore` rescaling the
data-parallel baseline, `explain()`'s warning on measured steps, the solver's new name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pipeline_support import OPTIMIZERS, mlp_case

import pdcompile
from pdcompile import CostGraph, Plan
from pdcompile.cli.handlers import main
from pdcompile.passes.planning.evaluation import rescore
from pdcompile.passes.planning.plan_words import ALTERNATIVE, describe, step_warning
from pdcompile.passes.planning.schedule_choice import auto_table
from pdcompile.passes.planning.solver_kit import SOLVERS
from pdcompile.passes.planning.timeline import Event
from pdcompile.pictures.gantt import KINDS, plot_timelines

FIGURE = r"(\d+\.\d\d (?:s|ms|us))"


def chain(times: list[float], outs: list[int], params: list[int]) -> CostGraph:
    g = CostGraph(batch_size=8)
    for i, (t, o, p) in enumerate(zip(times, outs, params, strict=True)):
        g.add_node(f"n{i}", forward_s=t / 3, backward_s=2 * t / 3, param_bytes=p, grad_bytes=p,
                   activation_bytes=o, output_bytes=o)  # fmt: skip
        if i:
            g.add_edge(f"n{i - 1}", f"n{i}", outs[i - 1])
    return g


def step_figures(text: str) -> list[str]:
    """Every step prediction `text` shows: the plan's summary line, the measured line of
    `explain()`, `pdcompile simulate`'s table title, the chosen rows of the schedule="auto"
    and microbatch-count comparisons, the recomputation line."""
    found = re.findall(r"predicted step " + FIGURE, text)
    found += re.findall(r"simulated step: " + FIGURE, text)
    found += re.findall(r"^\* M=\d+ x \d+ rows: step " + FIGURE, text, re.M)
    found += re.findall(r"; step " + FIGURE + " against", text)
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("schedule='auto' candidates"):
            header = re.split(r"\s{2,}", lines[i + 1].strip())
            chosen = next(r for r in lines[i + 2 :] if r.startswith("*"))
            found.append(re.split(r"\s{2,}", chosen)[header.index("step") + 1])
    return found


def agree(*texts: str) -> str:
    """The one step figure all of `texts` show (each shows at least one)."""
    figures = {text: step_figures(text) for text in texts}
    for text, found in figures.items():
        assert found, f"no step figure in:\n{text}"
    values = {f for found in figures.values() for f in found}
    assert len(values) == 1, f"step figures disagree: {figures}"
    return values.pop()


def test_step_figures_parse_every_place_and_catch_a_disagreement() -> None:
    text = (
        "predicted step 1.00 ms (4 microbatches)\n"
        "schedule='auto' candidates (* chosen: the fastest that fits):\n"
        "   schedule  chunks  replicas  M  step     vs chosen\n"
        "   gpipe     1       1,1       4  2.00 ms  +100.0%\n"
        "*  1f1b      1       1,1       4  1.00 ms  +0.0%\n"
        "* M=4 x 2 rows: step 3.00 ms, peak memory 1 KiB\n"
    )
    assert step_figures(text) == ["1.00 ms", "3.00 ms", "1.00 ms"]
    with pytest.raises(AssertionError, match="disagree"):
        agree(text)


def test_every_step_figure_of_one_plan_agrees(capsys, tmp_path: Path) -> None:
    """str(plan), the CLI's plan and simulate, explain() and its auto comparison: one step, before
    and after the plan is re-scored for the rows a train step ran."""
    model, x, y, loss_fn = mlp_case()
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False, progress=False)
    costs.save(tmp_path / "costs.json")
    cluster = "2@1GB/s"
    planned = pdcompile.plan(costs, cluster, schedule="auto")
    assert main(["plan", str(tmp_path / "costs.json"), "--cluster", cluster, "--schedule",
                 "auto"]) == 0  # fmt: skip
    cli_plan = capsys.readouterr().out
    step = agree(str(planned) + "\n" + auto_table(planned), cli_plan)

    pipe = pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"],
                             cluster=cluster, schedule="auto", costs=costs)  # fmt: skip
    assert agree(pipe.explain()) == step
    pipe.plan.save(tmp_path / "planned.json")
    assert main(["simulate", str(tmp_path / "planned.json")]) == 0
    assert agree(capsys.readouterr().out, str(pipe.plan)) == step

    pipe.train_step(x.repeat(3, 1), y.repeat(3))  # other rows: the plan is re-scored
    explained = pipe.explain()
    assert "measured over 1 steps" in explained and "planned at" in explained
    assert step_figures(explained).count(agree(explained)) >= 3  # summary, auto row, measured
    pipe.plan.save(tmp_path / "rescored.json")
    assert main(["simulate", str(tmp_path / "rescored.json")]) == 0
    assert agree(capsys.readouterr().out, explained) != step


def test_a_data_parallel_plan_says_1x_after_rescore() -> None:
    g = chain([0.01] * 6, [10**8] * 6, [1000] * 6)
    planned = pdcompile.plan(g, "4@100GB/s")
    assert planned.num_stages == 1 and planned.stages[0].replicas == 4
    for scored in (rescore(planned, microbatch_size=3), rescore(planned, num_microbatches=12),
                   rescore(planned, microbatch_size=32, num_microbatches=4)):  # fmt: skip
        assert scored.speedup_over_data_parallel == pytest.approx(1.0)
        assert "speed-up over data parallelism 1.00x" in str(scored)
        assert str(scored).startswith("data parallelism on 4 ranks")


def test_explain_of_a_data_parallel_plan_says_1x_after_rescore() -> None:
    model, x, y, loss_fn = mlp_case()
    pipe = pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"],
                             cluster="2@1000GB/s", profile=False)  # fmt: skip
    assert [s.replicas for s in pipe.plan.stages] == [2]
    pipe.train_step(x.repeat(2, 1), y.repeat(2))
    assert pipe.plan.microbatch_size != pipe.pipeline.program.plan.microbatch_size  # rescored
    text = pipe.explain()
    assert text.startswith("data parallelism on 2 ranks")
    assert "speed-up over data parallelism 1.00x" in text


def test_explain_warns_when_measured_and_predicted_steps_differ() -> None:
    model, x, y, loss_fn = mlp_case()
    pipe = pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"],
                             cluster="2", solver="uniform", profile=False)  # fmt: skip
    pipe.train_step(x, y)
    predicted = pipe.plan.step_time
    rows = x.shape[0]
    for factor, warned in ((1.0, False), (1.4, False), (0.7, False), (3.0, True), (0.5, True)):
        pipe._measured.clear()  # measured step times fed in: no timing in the test
        pipe._measured.extend((float(i), predicted * factor, rows) for i in range(5))
        text = pipe.explain()
        assert ("WARNING: the measured step" in text) == warned, factor
        if warned:
            how = "3.0x slower" if factor > 1 else "2.0x faster"
            assert how in text
            for remedy in ("pdcompile calibrate", "profile", "replan=True"):
                assert remedy in text


def test_step_warning_bounds() -> None:
    assert step_warning(1.0, 1.5) == step_warning(1.0, 1 / 1.5) == ""
    assert "1.6x slower" in step_warning(1.0, 1.6)
    assert "1.6x faster" in step_warning(1.6, 1.0)
    assert step_warning(0.0, 1.0) == ""  # a plan never simulated


def test_a_data_parallel_plan_says_why_and_how_to_pipeline_anyway() -> None:
    cluster = "4@10GB/s"
    cases = {  # costs -> the reason the pipeline lost
        "the model's largest node, n1": chain([0.001, 0.1, 0.001, 0.001], [1000] * 4, [10**6] * 4),
        "moving the activations between stages": chain([0.01] * 4, [10**9] * 4, [1000] * 4),
        "the stages cannot be balanced": chain([0.01] * 5, [1000] * 5, [10**6] * 5),
    }  # fmt: skip
    for reason, g in cases.items():
        planned = pdcompile.plan(g, cluster)
        first = str(planned).splitlines()[0]
        other = planned.options[ALTERNATIVE]
        slower = other["predicted_time"] / planned.predicted_time - 1
        assert first.startswith("data parallelism on 4 ranks: a pipeline of 4 stages"), first
        shown = f"{slower + 1:.1f}x slower" if slower >= 1 else f"{slower:.0%} slower"
        assert f"was predicted {shown}, because {reason}" in first, first
        assert f"--cluster {cluster} --solver blocks" in first
        assert "compile(..., solver='blocks')" in first
        # the way out gives the pipeline the sentence priced
        forced = pdcompile.plan(g, cluster, solver="blocks")
        assert forced.num_stages == other["num_stages"]
        assert forced.predicted_time == pytest.approx(other["predicted_time"])


def test_a_pipeline_says_its_shape_its_speed_up_and_its_bounding_node() -> None:
    g = chain([0.01, 0.2, 0.01, 0.01], [1000] * 4, [10**9] * 4)
    planned = pdcompile.plan(g, "4@1GB/s")
    first = str(planned).splitlines()[0]
    speedup = planned.speedup_over_data_parallel
    assert first.startswith(f"a pipeline of {planned.num_stages} stages over ")
    assert f"predicted {speedup:.2f}x faster than data parallelism on this cluster" in first
    assert "the model's largest node, n1 (200.00 ms per microbatch)" in first
    assert "bounds the pipeline" in first
    replicated = Plan.from_dict(planned.to_dict())  # a saved plan reads the same
    assert describe(replicated) == first
    one = pdcompile.plan(g, "1")
    assert str(one).startswith("the whole model on one rank: no pipeline")


def test_dp_is_the_old_name_of_dynprog_everywhere(capsys, tmp_path: Path) -> None:
    g = chain([0.01, 0.03, 0.02, 0.005], [1000] * 4, [10**6] * 4)
    assert "dp" in SOLVERS and "dynprog" in pdcompile.solvers() and "dp" not in pdcompile.solvers()
    new, old = pdcompile.plan(g, "4"), pdcompile.plan(g, "4", solver="dp")
    assert new.solver == old.solver == "dynprog" and new.stages == old.stages
    data = new.to_dict()
    data["solver"] = "dp"  # a plan saved before the rename
    assert Plan.from_dict(data).solver == "dynprog"
    path = tmp_path / "costs.json"
    g.save(path)
    assert main(["plan", str(path), "--cluster", "4", "--solver", "dp"]) == 0
    assert "Plan by dynprog for" in capsys.readouterr().out
    assert main(["solvers"]) == 0
    assert re.search(r"^dp\s+the old name of dynprog$", capsys.readouterr().out, re.M)
    assert "dp plan" not in str(new) and "by dp " not in str(new)


def test_gantt_keeps_idle_apart_from_communication(tmp_path: Path) -> None:
    ms = 1e-3
    events = [Event(0, "F", 0, 0, 0.0, ms), Event(0, "send", 0, 0, ms, 1.1 * ms, 1),
              Event(1, "recv", 1, 0, 0.0, 1.1 * ms, 0), Event(1, "F", 1, 0, 1.1 * ms, 2 * ms),
              Event(0, "allreduce", 0, -1, 2 * ms, 3 * ms)]  # fmt: skip
    assert "idle" in KINDS["recv"][0] and "communication" in KINDS["send"][0]
    assert "communication" in KINDS["allreduce"][0]
    assert KINDS["recv"][1] not in {KINDS[k][1] for k in ("send", "allreduce")}
    svg = tmp_path / "g.svg"
    plot_timelines([("one step", events)], svg)
    text = svg.read_text()
    for label in ("idle: waiting for a message", "idle: no action", "send (communication)"):
        assert label in text


def test_an_edited_plan_file_still_prints_and_rescores() -> None:
    g = chain([0.01] * 6, [10**8] * 6, [1000] * 6)
    planned = pdcompile.plan(g, "4@100GB/s")
    for largest, other in (("n1", {"num_stages": "x"}), ([1, 2], [3]), (["n1", -1.0], None)):
        broken = {"largest_node": largest, ALTERNATIVE: other, "auto": [5, {"step_time": "x"}]}
        edited = planned.with_(options={**planned.options, **broken})
        assert str(edited).startswith("data parallelism on 4 ranks; to pipeline anyway")
        assert rescore(edited, microbatch_size=2).speedup_over_data_parallel == pytest.approx(1.0)
