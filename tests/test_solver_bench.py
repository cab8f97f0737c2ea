"""`pdcompile bench-solvers` and its modules (`solver_bench`, `bench_instances`, `bench_report`):
instances, plugins, limits, reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import networkx as nx
import pytest
from rich.console import Console

from pdcompile import Cluster, CostGraph, PartitionError, SpecError, evaluate
from pdcompile.cli.bench_instances import (
    load_instance,
    load_instances,
    synthetic_chain,
    synthetic_dag,
)
from pdcompile.cli.bench_report import results_json, results_table, summary_table
from pdcompile.cli.handlers import main
from pdcompile.cli.solver_bench import BenchSettings, load_plugin, run_bench
from pdcompile.passes.planning import planner, solver_kit

DATA = Path(__file__).parent / "data" / "pipedream"
FAST = ["dynprog", "uniform", "params", "blocks", "pipedream"]

PLUGIN = '''
import os
import time

import pdcompile
from pdcompile.passes.planning.solver_kit import make_plan


@pdcompile.register_solver("one_stage")
def one_stage(cost_graph, cluster, options):
    """Every node in one stage on one device."""
    return make_plan(cost_graph, cluster, [(cost_graph.nodes, 1)], options, "one_stage")


@pdcompile.register_solver("broken")
def broken(cost_graph, cluster, options):
    """Raises a bug of its own."""
    return 1 / 0


@pdcompile.register_solver("sleepy")
def sleepy(cost_graph, cluster, options):
    """Never finishes in time."""
    time.sleep(60)


@pdcompile.register_solver("crashing")
def crashing(cost_graph, cluster, options):
    """Kills its process."""
    os._exit(3)
'''


@pytest.fixture
def plugin(tmp_path):
    """A plugin file; its module and the solvers it registers are removed afterwards."""
    path = tmp_path / "my_solvers.py"
    path.write_text(PLUGIN)
    solver_kit.solvers()  # the built-in solvers register once, on first use: before the snapshot
    saved, modules = dict(solver_kit.SOLVERS._items), set(sys.modules)
    yield str(path)
    solver_kit.SOLVERS._items.clear()
    solver_kit.SOLVERS._items.update(saved)
    for name in set(sys.modules) - modules:
        if name.startswith("_pdcompile_plugin_"):
            del sys.modules[name]


def render(table) -> str:
    console = Console(width=250, record=True, file=None)
    with console.capture() as capture:
        console.print(table)
    return capture.get()


def rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines()
            if line.startswith("│")]  # fmt: skip


# -- instances -------------------------------------------------------------------------------


def test_synthetic_chain_and_dag_are_deterministic_with_branches_and_skips() -> None:
    chain = synthetic_chain(50, seed=1)
    assert chain.nodes == [f"l{i}" for i in range(50)] and chain.graph.number_of_edges() == 49
    assert chain == synthetic_chain(50, seed=1) and chain != synthetic_chain(50, seed=2)
    for size in (1, 2, 3, 4, 7, 200):
        dag = synthetic_dag(size, seed=3)
        assert len(dag.nodes) == size and nx.is_directed_acyclic_graph(dag.graph)
        assert nx.is_weakly_connected(dag.graph)
    dag = synthetic_dag(200, seed=3)
    assert dag == synthetic_dag(200, seed=3) and dag != synthetic_dag(200, seed=4)
    assert max(d for _, d in dag.graph.out_degree()) >= 2  # branches
    assert max(d for _, d in dag.graph.in_degree()) >= 2  # merges of branches and skips
    edges = dag.graph.edges
    assert any(dag.nodes.index(v) - dag.nodes.index(u) > 3 for u, v in edges)  # long skips


def test_load_instance_reads_every_kind_of_input(tmp_path) -> None:
    (chain,) = load_instance("chain:12")
    assert chain.name == "chain:12" and chain.cost_graph == synthetic_chain(12, 0)
    (dag,) = load_instance("dag:30:5")
    assert dag.cost_graph == synthetic_dag(30, 5)
    assert [i.name for i in load_instance(str(DATA))] == [
        "gnmt",
        "nasnetalarge",
        "resnet50",
        "vgg16",
    ]
    (vgg,) = load_instance(str(DATA / "vgg16"))
    assert vgg.cost_graph == CostGraph.from_pipedream(DATA / "vgg16" / "graph.txt")
    assert load_instance(str(DATA / "vgg16" / "graph.txt"))[0].name == "vgg16"
    path = tmp_path / "small.json"
    synthetic_chain(5).save(path)
    (saved,) = load_instance(str(path))
    assert saved.name == "small" and saved.cost_graph == synthetic_chain(5)
    (model,) = load_instance("pdcompile.zoo:mlp", analytic=True)
    assert model.name == "pdcompile.zoo:mlp" and len(model.cost_graph.nodes) > 3
    twice = load_instances(["chain:4", "chain:4"])
    assert [i.name for i in twice] == ["chain:4", "chain:4 (2)"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("chain:0", "at least one node"),
        ("missing.json", "no such file or folder"),
        ("vgg17", "no such file or folder"),
        ("pdcompile.zoo:nothing", "has no attribute 'nothing'"),
    ],
)
def test_bad_inputs_are_spec_errors(text, words) -> None:
    with pytest.raises(SpecError, match=words):
        load_instance(text)


def test_a_folder_without_profiles_or_a_graph_without_nodes_is_an_error(tmp_path) -> None:
    with pytest.raises(SpecError, match="no graph.txt in this folder"):
        load_instance(str(tmp_path))
    CostGraph().save(tmp_path / "empty.json")
    with pytest.raises(SpecError, match="empty.json has no nodes; nothing to plan"):
        load_instance(str(tmp_path / "empty.json"))


# -- running and scoring ---------------------------------------------------------------------


def test_every_solver_on_every_instance_scored_by_evaluate() -> None:
    instances = [*load_instance(str(DATA / "vgg16")), *load_instance("chain:20"),
                 *load_instance("dag:25"), *load_instance("pdcompile.zoo:mlp")]  # fmt: skip
    clusters = [Cluster.parse("4@1.25GB/s"), Cluster.parse("2@10GB/s,2@1.25GB/s")]
    results = run_bench(instances, clusters, FAST, BenchSettings(schedule="pipedream"))
    assert len(results) == len(instances) * len(clusters) * len(FAST)
    assert all(r.status == "ok" and r.schedule == "pipedream" for r in results)
    for instance in instances:
        for cluster in clusters:
            group = [r for r in results if (r.instance, r.cluster) == (instance.name, str(cluster))]
            assert [r.solver for r in group] == FAST
            assert min(r.ratio_to_best for r in group) == 1.0
            best = min(r.predicted_time for r in group)
            for r in group:
                assert r.ratio_to_best == pytest.approx(r.predicted_time / best)
                assert r.gap == pytest.approx(r.predicted_time / r.lower_bound - 1)
                assert r.solve_time_s >= 0 and 1 <= r.num_devices_used <= 4
    # pipedream's own predicted time is replaced by evaluate's
    vgg = next(r for r in results if r.instance == "vgg16" and r.solver == "pipedream")
    made = planner.plan(instances[0].cost_graph, clusters[0], solver="pipedream",
                         schedule="pipedream")  # fmt: skip
    assert vgg.predicted_time == evaluate(made, instances[0].cost_graph).predicted_time
    assert vgg.predicted_time != made.predicted_time


def test_slow_exact_solvers_on_a_tiny_instance_with_a_time_limit() -> None:
    results = run_bench(load_instance("dag:8"), [Cluster.parse("3")], ["ideal", "cpsat", "dynprog"],
                        BenchSettings(time_limit_s=60))  # fmt: skip
    by = {r.solver: r for r in results}
    assert all(r.status == "ok" for r in results)
    assert by["ideal"].predicted_time <= by["dynprog"].predicted_time + 1e-12
    assert by["cpsat"].predicted_time <= by["dynprog"].predicted_time + 1e-12
    hierarchical = run_bench(load_instance("chain:6"), [Cluster.parse("2,2")], ["ideal"])
    assert hierarchical[0].note.startswith("fell back to dynprog:")


def test_unknown_solvers_and_bad_limits_are_clear_errors() -> None:
    chain = load_instance("chain:5")
    with pytest.raises(PartitionError, match=r"unknown solver\(s\) 'magic'.*registered: .*dynprog"):
        run_bench(chain, [Cluster.parse("2")], ["dynprog", "magic"])
    with pytest.raises(PartitionError, match="positive number of seconds"):
        run_bench(chain, [Cluster.parse("2")], ["dynprog"], BenchSettings(time_limit_s=-1))


# -- plugins, failures, limits ---------------------------------------------------------------


def test_a_plugin_solver_joins_and_failures_are_results(plugin) -> None:
    chain = load_instance("chain:8")
    results = run_bench(chain, [Cluster.parse("4")], ["one_stage", "broken", "dynprog"],
                        BenchSettings(plugins=[plugin]))  # fmt: skip
    by = {r.solver: r for r in results}
    assert by["one_stage"].status == "ok" and by["one_stage"].num_stages == 1
    assert by["one_stage"].ratio_to_best > 1 and by["dynprog"].ratio_to_best == 1.0
    assert by["broken"].status == "failed" and by["broken"].predicted_time is None
    assert by["broken"].note == "ZeroDivisionError: division by zero"
    assert {"one_stage", "broken", "sleepy"} <= set(solver_kit.solvers())


def test_timeouts_and_crashes_in_the_worker_never_end_the_run(plugin) -> None:
    results = run_bench(load_instance("chain:6"), [Cluster.parse("2")],
                        ["sleepy", "dynprog", "crashing", "one_stage", "broken"],
                        BenchSettings(time_limit_s=2.0, plugins=[plugin]))  # fmt: skip
    by = {r.solver: r for r in results}
    assert by["sleepy"].status == "timeout" and "time limit of 2 s" in by["sleepy"].note
    assert by["crashing"].status == "failed" and "exit code 3" in by["crashing"].note
    assert by["broken"].status == "failed" and "ZeroDivisionError" in by["broken"].note
    assert by["dynprog"].status == by["one_stage"].status == "ok"  # fresh workers after each kill
    assert by["dynprog"].ratio_to_best == 1.0


def test_plugins_that_fail_to_load_are_named(tmp_path) -> None:
    bad = tmp_path / "bad_plugin.py"
    bad.write_text("raise RuntimeError('no licence')\n")
    with pytest.raises(SpecError, match=r"plugin .*bad_plugin.py.* raised RuntimeError\('no lic"):
        load_plugin(str(bad))
    with pytest.raises(SpecError, match="plugin 'no_such.module': no module named 'no_such'"):
        load_plugin("no_such.module")
    (tmp_path / "needs_dep.py").write_text("import not_installed_dep\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(SpecError, match=r"'needs_dep': importing it raised ModuleNotFoundErr"):
            load_plugin("needs_dep")
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(SpecError, match="no such file"):
        load_plugin(str(tmp_path / "absent.py"))
    assert load_plugin("json") is json


# -- reports ---------------------------------------------------------------------------------


def test_tables_and_json_report_every_field(plugin) -> None:
    instances = load_instances(["chain:10", "dag:100:1"])  # ":100:" is an emoji code to rich
    results = run_bench(instances, [Cluster.parse("2")], ["dynprog", "uniform", "broken"],
                        BenchSettings(plugins=[plugin]))  # fmt: skip
    text = render(results_table(results))
    assert "schedule 1f1b, plans scored under evaluate" in text
    table = rows(text)
    assert [r[:3] for r in table if r[0]] == [["chain:10", "2@12.5GB/s", "dynprog"],
                                              ["dag:100:1", "2@12.5GB/s", "dynprog"]]  # fmt: skip
    broken = next(r for r in table if r[2] == "broken")
    assert broken[3] == "failed" and broken[-1] == "ZeroDivisionError: division by zero"
    dp = next(r for r in table if r[2] == "dynprog")
    assert dp[4] == "1.000" and dp[10].endswith(" s") and dp[9] == "yes"
    summary = rows(render(summary_table(results)))
    assert summary[0][:4] == ["dynprog", "2/2", "2", "1.000"] and summary[-1][:3] == [
        "broken",
        "0/2",
        "0",
    ]
    data = json.loads(results_json(results, instances, schedule="1f1b"))
    assert data["format"] == "pdcompile.solver_bench" and data["settings"] == {"schedule": "1f1b"}
    assert [i["nodes"] for i in data["instances"]] == [10, 100]
    record = data["results"][0]
    assert record["solver"] == "dynprog" and record["ratio_to_best"] == 1.0
    assert set(record) >= {"predicted_time", "lower_bound", "gap", "solve_time_s", "status"}
    assert data["summary"][0]["solver"] == "dynprog" and data["summary"][0]["best"] == 2


def test_one_instance_table_names_it_in_the_title() -> None:
    results = run_bench(load_instance("chain:6"), [Cluster.parse("2")], ["dynprog", "uniform"])
    text = render(results_table(results))
    assert "chain:6 on 2@12.5GB/s, schedule 1f1b" in text
    assert [r[0] for r in rows(text)] == ["dynprog", "uniform"] and rows(text)[0][2] == "1.000"


# -- the command -----------------------------------------------------------------------------


def test_bench_solvers_command_prints_tables_and_writes_json(capsys, tmp_path, plugin) -> None:
    out_json = tmp_path / "bench.json"
    code = main([
        "bench-solvers", str(DATA / "vgg16"), "--cluster", "4@1.25GB/s",
        "--cluster", "2@10GB/s,2@1.25GB/s", "--solvers", "dynprog,blocks,one_stage",
        "--plugin", plugin, "--schedule", "pipedream", "--json", str(out_json),
    ])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0 and f"wrote {out_json}" in err, err
    assert "schedule pipedream, plans scored under evaluate" in out
    table, summary = [r for r in rows(out) if len(r) == 11], [r for r in rows(out) if len(r) == 6]
    assert [r[:3] for r in table if r[0]] == [
        ["vgg16", "4@1.25GB/s", "dynprog"], ["vgg16", "2@10GB/s,2@1.25GB/s", "dynprog"]
    ]  # fmt: skip
    assert "per solver, over every instance and cluster" in out
    assert summary[0][:4] == ["dynprog", "2/2", "2", "1.000"] and len(summary) == 3
    data = json.loads(out_json.read_text())
    assert len(data["results"]) == 2 * 3 and data["instances"][0]["name"] == "vgg16"
    assert data["settings"] == {
        "clusters": ["4@1.25GB/s", "2@10GB/s,2@1.25GB/s"], "memory": None,
        "schedule": "pipedream", "num_microbatches": None, "time_limit_s": 60.0,
        "plugins": [plugin],
    }  # fmt: skip
    assert {r["status"] for r in data["results"]} == {"ok"}


def test_bench_solvers_command_reports_a_timeout(capsys, tmp_path, plugin) -> None:
    out_json = tmp_path / "b.json"
    code = main(["bench-solvers", "chain:6", "--cluster", "2", "--solvers", "sleepy,dynprog",
                 "--plugin", plugin, "--time-limit", "3", "--json", str(out_json)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "chain:6 on 2@12.5GB/s" in out
    table = rows(out)
    assert table[0][0] == "dynprog" and table[0][2] == "1.000"
    assert table[1][:2] == ["sleepy", "timeout"]
    assert table[1][-1] == "no plan within the time limit of 3 s"
    data = json.loads(out_json.read_text())
    assert [r["status"] for r in data["results"]] == ["timeout", "ok"]


def test_bench_solvers_command_errors_are_one_line(capsys, tmp_path) -> None:
    code = main(["bench-solvers", "chain:5", "--cluster", "2", "--solvers", "dynprog,magic"])
    err = capsys.readouterr().err
    assert code == 1 and "unknown solver(s) 'magic'" in err and err.count("\n") == 1
    bad = tmp_path / "bad.py"
    bad.write_text("import nothing_here\n")
    code = main(["bench-solvers", "chain:5", "--cluster", "2", "--plugin", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and "plugin" in err and "nothing_here" in err
    code = main(["bench-solvers", "nowhere.txt", "--cluster", "2"])
    assert code == 2 and "no such file or folder" in capsys.readouterr().err
