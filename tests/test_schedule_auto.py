"""`plan(..., schedule="auto")`, `compile(schedule="auto")`, `pdcompile plan --schedule auto` and
`pdcompile bench-solvers --schedules` (issue 19): the chosen plan is the fastest fitting one of
the single-schedule plans, by construction, and the table lists every candidate."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from pipeline_support import OPTIMIZERS, accumulate_reference, mlp_case

import pdcompile
from pdcompile import Cluster, CostGraph, PartitionError, Plan, PlanWarning
from pdcompile.cli.bench_instances import load_instance
from pdcompile.cli.handlers import main
from pdcompile.cli.solver_bench import BenchSettings, run_bench
from pdcompile.passes.planning.microbatch_count import TIE, fastest_fitting
from pdcompile.passes.planning.schedule_choice import auto_table, candidates, layouts
from pdcompile.scheduling import get_schedule, schedules


def chain(times: list[float], params: list[int], outs: list[int]) -> CostGraph:
    g = CostGraph(batch_size=8)
    for i, (t, p, o) in enumerate(zip(times, params, outs, strict=True)):
        g.add_node(f"n{i}", forward_s=t / 3, backward_s=2 * t / 3, param_bytes=p, grad_bytes=p,
                   activation_bytes=4 * o, output_bytes=o)  # fmt: skip
        if i:
            g.add_edge(f"n{i - 1}", f"n{i}", outs[i - 1])
    return g


EQUAL = CostGraph.load("docs/pictures/chain8.json")  # 8 equal layers
HEAVY_HEAD = chain([1.0] * 7 + [6.0], [10**6] * 7 + [8 * 10**6], [10**5] * 8)
RAGGED = chain([1.0, 3.0, 0.5, 2.0, 1.0, 0.5], [10**6] * 6, [10**6, 10**5, 10**6, 10**5, 10**6, 1])
GRAPHS = {"equal": EQUAL, "heavy-head": HEAVY_HEAD, "ragged": RAGGED}
CLUSTERS = ("4@10GB/s", "2@10GB/s,2@100MB/s")


def singles(costs: CostGraph, cluster: Cluster, **kwargs) -> dict[tuple[str, int], Plan]:
    """Every synchronous schedule's fastest fitting plan over the `layouts` auto tries, each as
    `plan()` makes it (schedules it cannot plan left out)."""
    out = {}
    devices = Cluster.coerce(cluster).num_devices
    for name, v in candidates():
        plans = []
        for counts in layouts(devices, v, None):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", PlanWarning)
                    plans.append(pdcompile.plan(costs, cluster, schedule=name, chunks=v,
                                                replica_counts=counts, **kwargs))  # fmt: skip
            except PartitionError:
                continue
        if plans:
            out[name, v] = plans[fastest_fitting(plans)]
    return out


def _auto(costs: CostGraph, cluster: Cluster, **kwargs) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        return pdcompile.plan(costs, cluster, schedule="auto", **kwargs)


def _limits(costs: CostGraph, text: str) -> list[Cluster]:
    """No memory limit, and one that only 1F1B-like activations fit (some candidates do not)."""
    peak = max(pdcompile.plan(costs, text).rank_memory)
    return [Cluster.parse(text), Cluster.parse(text, memory=1.05 * peak)]


@pytest.mark.parametrize("graph", sorted(GRAPHS))
@pytest.mark.parametrize("text", CLUSTERS)
def test_auto_is_the_fastest_fitting_single_schedule_plan(graph: str, text: str) -> None:
    costs = GRAPHS[graph]
    for cluster in _limits(costs, text):
        chosen = _auto(costs, cluster)
        others = singles(costs, cluster)
        fitting = {k: p for k, p in others.items() if p.fits_memory}
        assert fitting and chosen.fits_memory
        assert all(chosen.step_time <= p.step_time * (1 + TIE) for p in fitting.values())
        best_single = min(p.step_time for p in fitting.values())
        if chosen.schedule in {n for n, _ in candidates()}:
            assert chosen.step_time == pytest.approx(best_single, rel=TIE)
        rows = chosen.options["auto"]
        plain, refined = rows[: len(candidates())], rows[len(candidates()) :]
        assert [(r["schedule"], r["chunks"]) for r in plain] == candidates()
        assert [r["schedule"] for r in refined] == ["synth"]  # fitted to the best plain one
        assert sum(r["chosen"] for r in rows) == 1
        (row,) = [r for r in rows if r["chosen"]]
        assert row["schedule"] == chosen.schedule and row["step_time"] == chosen.step_time
        if row in plain:
            same = others[row["schedule"], row["chunks"]]
            assert same.step_time == chosen.step_time and row["step_time"] <= refined[0][
                "step_time"
            ] * (1 + TIE)
            assert [s.nodes for s in same.stages] == [s.nodes for s in chosen.stages]
        for r in plain:  # each row is what plan() gives for that schedule alone
            if r["skipped"]:
                assert (r["schedule"], r["chunks"]) not in others
            else:
                single = others[r["schedule"], r["chunks"]]
                assert r["step_time"] == single.step_time
                assert r["fits_memory"] == single.fits_memory
                assert r["peak_memory"] == max(single.rank_memory)
                assert r["replicas"] == [s.replicas for s in single.stages]


def test_a_tight_memory_limit_rules_faster_schedules_out() -> None:
    cluster = _limits(EQUAL, "4@10GB/s")[1]
    chosen = _auto(EQUAL, cluster, recompute=False)  # recomputing, every candidate fits
    rows = chosen.options["auto"]
    assert any(r["skipped"] or not r["fits_memory"] for r in rows)
    table = auto_table(chosen)
    assert "skipped" in table or "NO" in table


def test_asynchronous_schedules_are_candidates_only_when_allowed() -> None:
    sync = {n for n, _ in candidates()}
    assert "pipedream" not in sync and "2bw" not in sync
    fitted = {n for n in schedules() if get_schedule(n).fits_plans}
    assert fitted == {"synth"}  # fitted to the best candidate, not a candidate
    assert sync == {n for n in schedules() if get_schedule(n).synchronous} - fitted
    plan = _auto(EQUAL, "4@10GB/s")
    assert {r["schedule"] for r in plan.options["auto"]} == sync | fitted
    loose = _auto(EQUAL, "4@10GB/s", allow_async=True)
    assert {"pipedream", "2bw"} <= {r["schedule"] for r in loose.options["auto"]}
    assert loose.step_time <= plan.step_time * (1 + TIE)


def test_zb_h1_is_tried_with_one_and_two_chunks() -> None:
    assert ("zb-h1", 1) in candidates() and ("zb-h1", 2) in candidates()
    assert ("zb-v", 2) in candidates() and ("interleaved-1f1b", 2) in candidates()


def test_the_table_survives_json() -> None:
    plan = _auto(RAGGED, "4@10GB/s")
    again = Plan.from_json(plan.to_json())
    assert again.options["auto"] == plan.options["auto"]
    assert again.to_json() == plan.to_json()
    assert auto_table(again) == auto_table(plan)
    json.loads(plan.to_json())  # plain JSON


def test_an_explicit_microbatch_count_skips_schedules_that_refuse_it() -> None:
    plan = _auto(EQUAL, "4@10GB/s", num_microbatches=6)
    assert plan.num_microbatches == 6
    skipped = {r["schedule"]: r["skipped"] for r in plan.options["auto"] if r["skipped"]}
    assert "zb-v" in skipped and "multiple of 4" in skipped["interleaved-1f1b"]
    assert all(r["num_microbatches"] == 6 for r in plan.options["auto"] if not r["skipped"])
    assert "skipped zb-v (chunks=2)" in auto_table(plan)


def test_no_candidate_at_all_says_why_for_each() -> None:
    with pytest.raises(PartitionError, match="no schedule could be planned.*1f1b"):
        _auto(EQUAL, Cluster.parse("4@10GB/s", memory=1000))


def test_unknown_schedules_and_chunks_with_auto_are_refused() -> None:
    with pytest.raises(PartitionError, match="unknown schedule"):
        pdcompile.plan(EQUAL, "4", schedule="autox")
    with pytest.raises(PartitionError, match="chooses the chunks"):
        pdcompile.plan(EQUAL, "4", schedule="auto", chunks=2)


def test_plan_command_prints_the_table(capsys) -> None:
    code = main(["plan", "docs/pictures/chain8.json", "--cluster", "4@10GB/s", "--schedule",
                 "auto"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "schedule='auto' candidates" in out
    for name, _ in candidates():
        assert name in out
    assert "pipedream" not in out.split("candidates")[1]
    code = main(["plan", "docs/pictures/chain8.json", "--cluster", "4@10GB/s", "--schedule",
                 "auto", "--allow-async"])  # fmt: skip
    assert code == 0 and "pipedream" in capsys.readouterr().out


def test_bench_solvers_compares_solver_schedule_pairs(capsys) -> None:
    results = run_bench(load_instance("chain:10"), [Cluster.parse("4")], ["dynprog", "uniform"],
                        BenchSettings(schedules=["1f1b", "zb-v", "auto"]))  # fmt: skip
    assert [(r.solver, r.schedule) for r in results] == [
        (s, k) for s in ("dynprog", "uniform") for k in ("1f1b", "zb-v", "auto")
    ]
    assert all(r.status == "ok" and r.step_time for r in results)
    assert min(r.step_ratio for r in results) == pytest.approx(1.0)
    for solver in ("dynprog", "uniform"):  # auto is at least as fast as each schedule it covers
        mine = {r.schedule: r.step_time for r in results if r.solver == solver}
        assert mine["auto"] <= min(mine["1f1b"], mine["zb-v"]) * (1 + TIE)
    code = main(["bench-solvers", "chain:8", "--cluster", "2", "--solvers", "dp",
                 "--schedules", "1f1b,zb-h1", "--time-limit", "0"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "dynprog / 1f1b" in out and "dynprog / zb-h1" in out
    with pytest.raises(PartitionError, match="unknown schedule"):
        run_bench(load_instance("chain:4"), [Cluster.parse("2")], ["dynprog"],
                  BenchSettings(schedules=["nope"]))  # fmt: skip


def test_compile_auto_runs_the_chosen_schedule_and_explains_the_choice() -> None:
    model, x, y, loss_fn = mlp_case()
    sgd = OPTIMIZERS["sgd"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        pipe = pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=sgd, cluster="2",
                                 schedule="auto", profile=False,
                                 global_batch_size=len(x))  # fmt: skip
    assert pipe.plan.schedule in {n for n, _ in candidates()}
    plan = pipe.plan  # the count chosen among those dividing the batch, for every schedule
    assert plan.num_microbatches * plan.microbatch_size == len(x)
    assert all(r["counts_tried"] for r in plan.options["auto"] if not r["skipped"])
    assert pipe.pipeline.rules.name == pipe.plan.schedule
    losses = [pipe.train_step(x, y) for _ in range(2)]
    ref, ref_loss = accumulate_reference(
        model, x, y, loss_fn, sgd, pipe.pipeline.num_microbatches, 2
    )
    for name, tensor in ref.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], tensor, msg=name)
    assert losses[-1] == pytest.approx(ref_loss, rel=1e-5)
    text = pipe.explain()
    assert "schedule='auto' candidates" in text and f"schedule {pipe.plan.schedule}:" in text


def test_chunked_plans_bisect_the_stage_budget_until_the_ranks_fit() -> None:
    """zb-v holds 1F1B's activations, so it fits where 1F1B's plan does; the solver's virtual
    1F1B over 2p stages with half a device each found no cut there (its counts are not zb-v's),
    and the budget is now searched against the simulated ranks."""
    peak = max(pdcompile.plan(EQUAL, "4@10GB/s").rank_memory)
    cluster = Cluster.parse("4@10GB/s", memory=peak)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        plan = pdcompile.plan(EQUAL, cluster, schedule="zb-v")
    assert plan.fits_memory and max(plan.rank_memory) <= peak
    assert plan.step_time < pdcompile.plan(EQUAL, cluster).step_time


def test_layouts_the_solver_ties_on_are_told_apart_by_the_step_time() -> None:
    """On 8 equal layers and 4 devices a straight pipeline and data parallelism have the same
    bottleneck stage (the solver's objective), but the pipeline fills and drains: auto plans
    both and keeps the shorter step."""
    assert layouts(4, 1, None) == [None, (1,), (2,), (4,)]
    assert layouts(4, 2, None) == [None] and layouts(4, 1, [1, 2]) == [(1, 2)]
    solver = pdcompile.plan(EQUAL, "4@10GB/s", schedule="1f1b")
    chosen = _auto(EQUAL, "4@10GB/s")
    assert chosen.predicted_time == pytest.approx(solver.predicted_time, rel=0.01)
    assert chosen.step_time < 0.8 * solver.step_time
    assert [s.replicas for s in chosen.stages] == [4]
    assert "replicas" in auto_table(chosen)
