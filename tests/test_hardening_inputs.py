"""Bounded inputs and validated arguments (issue 22, hardening items 3 to 6).

Each test reproduces what a hostile review found on main: counts that hung or exhausted memory
(`num_microbatches=10**9`, `cluster="99999999999"`, a plan for 100000 devices), costs that
overflowed (1e308 seconds, 1e300 bytes) or made plans their own loader refused, plan files
accepted with negative or infinite figures or a rank outside the job, and arguments taken that
train wrongly or fail later with a raw error. Each now raises a `PdcompileError` naming the
value, the cap or rule, and the way out.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from pipeline_support import OPTIMIZERS, mlp_case
from rich.console import Console
from spawn import run_ranks

import pdcompile
from pdcompile import Cluster, CostGraph, Plan
from pdcompile.cli.bench_instances import synthetic_chain
from pdcompile.cli.handlers import main
from pdcompile.cli.progress import progress
from pdcompile.core.cluster import MAX_DEVICES
from pdcompile.core.cost_graph_json import MAX_BYTES
from pdcompile.core.errors import CostError, PartitionError, PdcompileError, ScheduleError
from pdcompile.passes.planning.simulator import MAX_ACTIONS, simulated_actions
from pdcompile.passes.planning.validate import check_layout
from pdcompile.runtime.distributed import init_process_group
from pdcompile.scheduling import get_schedule
from pdcompile.scheduling.base import MAX_MICROBATCHES

GNMT = Path(__file__).parent / "data" / "pipedream" / "gnmt" / "graph.txt"
COSTS = CostGraph.from_pipedream(GNMT, batch_size=64)
PLAN = pdcompile.plan(COSTS, 4)  # 3 stages on 4@12.5GB/s


def _mlp_plan() -> Plan:
    model, x, _, _ = mlp_case()
    costs = pdcompile.analyze(pdcompile.trace(model, (x,)), (x,), profile=False)
    return pdcompile.plan(costs, 2, solver="uniform", num_microbatches=2)


PLAN_MLP = _mlp_plan()  # MLP on 2 stages


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *fragments: str) -> None:
    """A command failed with one line on standard error holding `fragments`, no traceback."""
    assert code in (1, 2) and err.startswith("pdcompile: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


# item 3: oversized counts --------------------------------------------------------------------


def test_num_microbatches_above_the_cap_is_refused_by_plan_simulate_and_their_commands(
    capsys, tmp_path
) -> None:
    cap = rf"num_microbatches=1000000000 is above the cap of {MAX_MICROBATCHES} microbatches"
    with pytest.raises(PartitionError, match=cap + r".*MAX_MICROBATCHES\); use fewer"):
        pdcompile.plan(COSTS, 2, num_microbatches=10**9)  # said "accepts none of replica_counts"
    with pytest.raises(PartitionError, match=cap):
        pdcompile.simulate(PLAN, num_microbatches=10**9)
    with pytest.raises(PartitionError, match=cap):  # a plan object carrying the count
        pdcompile.simulate(PLAN.with_(num_microbatches=10**9))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**PLAN.to_dict(), "num_microbatches": 10**9}))
    with pytest.raises(PartitionError, match=f"{path}: {cap}"):
        Plan.load(path)
    for argv in (("plan", GNMT, "--cluster", "2"), ("simulate", GNMT, "--cluster", "2")):
        code, _, err = run(capsys, *argv, "--microbatches", 10**9)
        one_line_error(code, err, "is above the cap of 65536 microbatches")
    code, _, err = run(capsys, "simulate", path)
    one_line_error(code, err, str(path), "is above the cap")


@pytest.mark.parametrize("text", ["99999999999", "1000000", "1024,1024", "2@1GB/s,100000@1GB/s"])
def test_device_counts_above_the_cap_are_refused_while_parsing(text: str) -> None:
    # '99999999999' raised MemoryError listing its ranks; '1000000' planned for minutes
    with pytest.raises(PartitionError, match=rf"above the cap of {MAX_DEVICES} "
                       r"\(pdcompile.core.cluster.MAX_DEVICES\); check the counts"):  # fmt: skip
        Cluster.parse(text)


def test_every_other_way_to_a_cluster_has_the_device_cap() -> None:
    match = f"above the cap of {MAX_DEVICES}"
    with pytest.raises(PartitionError, match=r"cluster=1000000: a cluster of 1000000 devices "):
        Cluster.coerce(10**6)
    with pytest.raises(PartitionError, match=match):
        Cluster([(10**12, 1e9)])
    with pytest.raises(PartitionError, match=match):
        Cluster.from_dict({"levels": [[2**62, 1e9, 0.0]], "memory": None, "speed": None})
    assert Cluster.parse(str(MAX_DEVICES)).num_devices == MAX_DEVICES


@pytest.mark.timeout(120)
def test_a_plan_for_a_large_cluster_says_its_simulation_is_over_the_budget() -> None:
    # plan(costs, 100000) looped forever (twice the devices is above the schedules' cap)
    budget = (
        r"above the budget of 2,000,000 \(pdcompile.passes.planning.simulator.MAX_ACTIONS\); use"
    )
    size = r"simulating 65536 microbatches of \d+ stages on 100000 ranks under 1f1b"
    with pytest.raises(PartitionError, match=rf"{size} runs about [\d,]+ actions.*, {budget}"):
        pdcompile.plan(COSTS, 100000)


@pytest.mark.timeout(120)
def test_a_simulation_over_the_action_budget_is_refused_before_it_starts() -> None:
    six = pdcompile.plan(COSTS, 8, replica_counts=[1], num_microbatches=16)  # 6 stages, a chain
    assert six.num_stages == 6
    rules = get_schedule("1f1b")
    assert simulated_actions(six.with_(num_microbatches=MAX_MICROBATCHES), rules, 1) > MAX_ACTIONS
    with pytest.raises(PartitionError, match=r"runs about [\d,]+ actions, above the budget"):
        pdcompile.simulate(six, num_microbatches=MAX_MICROBATCHES)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "pipedream", "2bw", "zb-h1"])
def test_the_action_estimate_is_within_a_quarter_of_the_actions_run(schedule: str) -> None:
    plan = pdcompile.plan(COSTS, 8, schedule=schedule, num_microbatches=16)
    sim = pdcompile.simulate(plan)
    actions = sum(len(a) for a in sim.schedule.actions.values())
    steps = sim.schedule.num_microbatches // plan.num_microbatches
    estimate = simulated_actions(plan, get_schedule(schedule), steps)
    assert 0.75 * actions <= estimate <= 1.25 * actions, (estimate, actions)


# item 4: loaders and the command line ----------------------------------------------------------


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    PLAN.save(path)
    return path


def test_deeply_nested_json_is_refused_by_every_command_reading_files(capsys, tmp_path, plan_file):
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    commands = [  # each raised a raw RecursionError or read the file as something else
        ("simulate", nested),
        ("simulate", nested, "--cluster", "2"),
        ("simulate", plan_file, "--measured", nested, "--png", tmp_path / "g.png"),
        ("plan", GNMT, "--cluster", "2", "--measured", nested),
        ("graph", nested),
        ("codegen", "pdcompile.zoo:mlp", "--plan", nested, "--out", tmp_path / "stages"),
        ("bench-solvers", nested, "--cluster", "2", "--time-limit", "0"),
    ]
    for argv in commands:
        code, _, err = run(capsys, *argv)
        one_line_error(code, err, str(nested))


def _edited_profile(tmp_path: Path, old: str, new: str) -> Path:
    text = GNMT.read_text()
    assert old in text
    path = tmp_path / "graph.txt"
    path.write_text(text.replace(old, new, 1))
    return path


def test_huge_costs_are_refused_by_the_loaders_naming_the_node_and_the_cap(capsys, tmp_path):
    doc = json.loads(COSTS.to_json())
    for node in doc["nodes"]:  # every node: their sums overflowed to inf
        node.update(forward_s=1e308, backward_s=1e308)
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(doc))
    seconds = r"forward_s is 1e\+308 seconds, above the 1e\+12 one node may cost " \
              r"\(pdcompile.core.cost_graph_json.MAX_SECONDS\)"  # fmt: skip
    with pytest.raises(CostError, match=rf"{costs}: node 'node1': {seconds}"):
        CostGraph.load(costs)
    huge = CostGraph(batch_size=4)  # in memory: refused when written, as it would be when read
    huge.add_node("n0", forward_s=1e300, backward_s=1.0)
    for write in (huge.to_json, lambda: huge.to_pipedream(tmp_path / "huge.txt")):
        with pytest.raises(CostError, match=r"CostGraph.to_\w+: node 'n0': forward_s is 1e\+300"):
            write()
    # OverflowError in `graph`, IndexError in `plan` and `simulate`
    for argv in (("graph", costs), ("plan", costs, "--cluster", "2"),
                 ("simulate", costs, "--cluster", "2")):  # fmt: skip
        code, _, err = run(capsys, *argv)
        one_line_error(code, err, "MAX_SECONDS")
    # PipeDream: parameter_size=1e300 gave "TypeError: ufunc 'isfinite'" in plan
    profile = _edited_profile(tmp_path, "parameter_size=67174400.000", "parameter_size=1e300")
    with pytest.raises(CostError, match=r"node 'node5': param_bytes is 1e\+300 bytes, above "
                       r"the 9.007e\+15 .*MAX_BYTES"):  # fmt: skip
        CostGraph.from_pipedream(profile)
    code, _, err = run(capsys, "plan", profile, "--cluster", "2")
    one_line_error(code, err, str(profile), "MAX_BYTES")
    profile = _edited_profile(tmp_path, "forward_compute_time=5.247", "forward_compute_time=1e308")
    with pytest.raises(CostError, match="node 'node5': forward_s is 1e\\+305 seconds"):
        CostGraph.from_pipedream(profile)


def _heavy_chain(nodes: int) -> CostGraph:
    """A chain whose every node keeps `MAX_BYTES` of activations: as much as a file may give."""
    g = CostGraph(batch_size=4)
    for i in range(nodes):
        g.add_node(f"n{i}", forward_s=1.0, backward_s=2.0, param_bytes=8, grad_bytes=8,
                   activation_bytes=MAX_BYTES, output_bytes=8)  # fmt: skip
        if i:
            g.add_edge(f"n{i - 1}", f"n{i}", 8)
    return g


def test_plans_hold_only_numbers_their_loader_reads(capsys, tmp_path) -> None:
    costs = tmp_path / "heavy.json"
    _heavy_chain(4).save(costs)
    # 2048 microbatches in flight of 4 x 2**53 bytes: 2**66 bytes, which `pdcompile plan`
    # wrote into a plan Plan.load refused; now plan() says so and nothing is written
    with pytest.raises(PartitionError, match=r"the plan cannot be written: stage #0: field "
                       r"'memory_bytes' is \d+, not int \(finite, >= 0, below 2\*\*63\); "
                       r"check the seconds and bytes"):  # fmt: skip
        pdcompile.plan(CostGraph.load(costs), 1, schedule="gpipe", num_microbatches=2048)
    out = tmp_path / "plan.json"
    code, _, err = run(capsys, "plan", costs, "--cluster", "1", "--schedule", "gpipe",
                       "--microbatches", 2048, "--out", out)  # fmt: skip
    one_line_error(code, err, "the plan cannot be written")
    assert not out.exists()
    code, _, err = run(capsys, "plan", costs, "--cluster", "1", "--schedule", "gpipe",
                       "--microbatches", 2, "--out", out)  # fmt: skip
    assert code == 0, err
    assert max(Plan.load(out).rank_memory) > 2**55  # what it wrote reads back


def test_a_long_plan_shows_its_progress_on_a_terminal() -> None:
    costs = synthetic_chain(120)
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=200)
    with progress("planning 120 nodes on 4 devices (dp)", console=terminal):
        pdcompile.plan(costs, 4)
    shown = screen.getvalue()
    assert "planning 120 nodes on 4 devices (dp)" in shown
    assert "bottleneck within 1e-12, goal 1e-12" in shown  # the bisection's last round
    assert "100%" in shown
    piped = io.StringIO()
    with progress("planning", console=Console(file=piped, force_terminal=False)):
        pdcompile.plan(costs, 4)
    assert piped.getvalue() == ""  # nothing drawn into a pipe or a file


# item 5: plans accepted that should not be -------------------------------------------------------

EDITS = {  # a plan file's field -> a value it must refuse, and the words that name it
    "negative time": (("stages", 0, "forward_s"), -1.0, "is -1.0, not float (finite, >= 0"),
    "infinite time": (("stages", 1, "backward_s"), math.inf, "field 'backward_s' is inf"),
    "infinite step": (("step_time",), math.inf, "field 'step_time' is inf, not float (finite"),
    "negative memory": (("stages", 0, "memory_bytes"), -5, "field 'memory_bytes' is -5"),
    "microbatch size 0": (("microbatch_size",), 0, "microbatch_size must be an integer >= 1"),
    "negative size": (("microbatch_size",), -3, "field 'microbatch_size' is -3"),
    "negative tie bytes": (("ties",), [[[0, 1], -8]], "field 'ties' is [[[0, 1], -8]]"),
    "rank outside": (("stages", 1, "ranks"), [7], "among its cluster's 4 devices (0 to 3)"),
    "ranks twice": (("stages", 2, "ranks"), [2, 2], "stage 2 runs on ranks [2, 2]"),
    "stage order": (("stages", 1, "index"), 5, "stage #1 has index 5"),
    "later source": (("stages", 0, "recv_bytes"), [[2, 8]], "a stage receives only from earlier"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_plan_files_with_figures_out_of_range_are_refused(edit: str, capsys, tmp_path) -> None:
    (*keys, last), value, words = EDITS[edit]
    doc = PLAN.to_dict()
    place = doc
    for key in keys:
        place = place[key]
    place[last] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PartitionError) as caught:
        Plan.load(path)
    assert str(caught.value).startswith(f"{path}: ") and words in str(caught.value)
    # `simulate` printed "bubble 1373131.3%" or "step inf s" for such files
    code, _, err = run(capsys, "simulate", path)
    one_line_error(code, err, words)


def test_check_layout_names_a_rank_outside_the_world() -> None:
    eight = _outside_the_world()
    check_layout(eight, 8)  # on its own cluster the plan is whole
    world = r"stage 1 runs on ranks \[7\], but the plan's stages need distinct ranks among"
    with pytest.raises(PartitionError, match=rf"{world} the job's 2 ranks \(0 to 1\)"):
        check_layout(eight, 2, world=True)
    with pytest.raises(PartitionError, match="places its stages on 2 devices but the job has 3"):
        check_layout(eight, 3, world=True)


def _outside_the_world() -> Plan:
    """MLP on 2 stages, the second on rank 7 of a cluster of 8 (2 devices used)."""
    stages = (PLAN_MLP.stages[0], replace(PLAN_MLP.stages[1], ranks=(7,)))
    return PLAN_MLP.with_(stages=stages, cluster=Cluster.parse("8"))


def _compile_outside_the_world(rank: int, world_size: int, init_file: str) -> tuple[str, str]:
    init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    model, x, _, loss_fn = mlp_case()
    try:
        pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"],
                          plan=_outside_the_world(), timeout=20)  # fmt: skip
    except PdcompileError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.timeout(240)
def test_a_rank_outside_the_world_is_the_same_error_on_every_rank() -> None:
    # was "ValueError: Global rank 7 is not part of group" on one rank, ScheduleError on the other
    results = run_ranks(_compile_outside_the_world, 2, timeout_s=200)
    assert results[0] == results[1], results
    kind, message = results[0]
    assert kind == "PartitionError" and "stage 1 runs on ranks [7]" in message, results


# item 6: arguments accepted that should not be ---------------------------------------------------


def _boom(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    raise RuntimeError("no optimizer today")


ARGUMENTS = {  # compile's argument -> (value, error class, words)
    "negative clip": ("clip_grad_norm", -1.0, ScheduleError, "must be a finite number > 0"),
    "nan clip": ("clip_grad_norm", math.nan, ScheduleError, "clip_grad_norm must be"),
    "zero timeout": ("timeout", 0, ScheduleError, "seconds > 0, got 0; the default is 300 s"),
    "negative timeout": ("timeout", -5.0, ScheduleError, "got -5.0"),
    "zero startup": ("startup_timeout", 0, ScheduleError, "startup_timeout must be"),
    "fractional count": ("num_microbatches", 2.5, PartitionError, "integer >= 1, got float 2.5"),
    "boolean count": ("num_microbatches", True, PartitionError, "got bool True"),
    "count above cap": ("num_microbatches", 10**9, PartitionError, "above the cap of 65536"),
    "optimizer instance": ("optimizer", "instance", CostError, "each stage's parameters, got SGD"),
    "failing factory": ("optimizer", _boom, CostError, "(RuntimeError: no optimizer today)"),
}


@pytest.mark.parametrize("case", list(ARGUMENTS))
def test_compile_refuses_arguments_that_would_train_wrongly_or_fail_later(case: str) -> None:
    name, value, error, words = ARGUMENTS[case]
    model, x, y, loss_fn = mlp_case()
    if value == "instance":
        value = torch.optim.SGD(model.parameters(), lr=0.1)
    options: dict[str, Any] = dict(loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"], plan=PLAN_MLP)
    with pytest.raises(error) as caught:  # a given plan: no profile checks the optimizer first
        pdcompile.compile(model, (x,), **{**options, name: value})
    assert words in str(caught.value)


def test_compile_with_valid_arguments_still_trains() -> None:
    model, x, y, loss_fn = mlp_case()
    pipe = pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"],
                             plan=PLAN_MLP, clip_grad_norm=1.0, timeout=30.0,
                             num_microbatches=2)  # fmt: skip
    assert math.isfinite(pipe.train_step(x, y))


def test_simulate_refuses_zero_microbatches_instead_of_ignoring_them() -> None:
    # `simulate --microbatches 0`: tests/test_cli_simulate.py::test_simulate_errors_are_one_line
    with pytest.raises(PartitionError, match="num_microbatches must be an integer >= 1, got int 0"):
        pdcompile.simulate(PLAN, num_microbatches=0)


def test_a_schedule_that_accepts_no_count_is_refused_not_searched_forever() -> None:
    from pdcompile.scheduling import get_schedule

    class Picky(type(get_schedule("1f1b"))):
        def check(self, replicas, num_microbatches, ties=()):  # noqa: ANN001, ANN201
            raise ScheduleError("accepts nothing")

    with pytest.raises(ScheduleError, match="accepts no microbatch count from 4 to 65536"):
        Picky().accepted_microbatches([1, 1], 4)
