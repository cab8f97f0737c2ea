"""The planner that chooses activation recomputation (`plan(..., memory=, recompute=)`,
`pdcompile.passes.planning.recompute_choice`), checked against runs.

The GPT-style decoder of `test_memory_model` on 2 devices: the smallest memory any plan without
recomputation fits in is found by bisection with `recompute=False`; under a limit below it the
planner recomputes the stages that need it (each one needed: without it the plan no longer
fits), reports the predicted slowdown, and 2 spawned gloo ranks trained by `compile(...,
memory=)` hold less than the limit, as predicted within 10%. Then the other answers: `False`
refuses, `True` recomputes every stage, a limit no plan fits names the least memory a plan
needs (which then fits), `memory="auto"`, and `schedule="auto"` under a limit.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from spawn import run_ranks
from test_memory_model import CASES, STEPS, TOLERANCE, M, _batch, _costs

import pdcompile
from pdcompile import Cluster, PartitionError
from pdcompile.passes.planning.recompute_choice import (
    KEY,
    MARGIN,
    host_memory,
    limited,
    recompute_table,
    segment_boundaries,
    with_recompute,
)
from pdcompile.runtime import memory_probe
from pdcompile.runtime.distributed import init_process_group

CASE = "gpt"


def planned(memory: float | None, **options) -> pdcompile.Plan:
    """The GPT's plan on 2 devices, as `compile` plans it in `test_runs_fit_under_the_limit`."""
    _, costs = _costs(CASE)
    return pdcompile.plan(costs, "2", num_microbatches=M, memory=memory, **options)


@functools.cache
def smallest_without_recompute() -> float:
    """The least memory limit under which a plan without recomputation fits (bisected to 0.1%
    over `plan(..., recompute=False)`, whose plans are simulated)."""
    low, high = 0.0, float(max(planned(None, recompute=False).rank_memory))
    while high - low > high * 1e-3:
        middle = (low + high) / 2
        try:
            fits = planned(middle, recompute=False).fits_memory
        except PartitionError:
            fits = False
        low, high = (low, middle) if fits else (middle, high)
    return high


def limit() -> float:
    """10% below the smallest limit that fits without recomputation."""
    return 0.9 * smallest_without_recompute()


def test_below_the_smallest_plan_without_it_the_planner_recomputes_what_needs_it() -> None:
    chosen = planned(limit())
    assert chosen.fits_memory and max(chosen.rank_memory) <= limit()
    recomputing = [s.index for s in chosen.stages if s.recompute]
    assert recomputing, chosen
    _, costs = _costs(CASE)
    forms = [s.recompute for s in chosen.stages]
    for s in recomputing:  # each one is needed: without it the plan no longer fits
        off = with_recompute(chosen, costs, [False if i == s else f for i, f in enumerate(forms)])
        assert not off.fits_memory, s
    info = chosen.options[KEY]
    without = with_recompute(chosen, costs, [False] * chosen.num_stages)
    assert info["without_s"] == without.step_time and info["without_peak"] > limit()
    assert info["slowdown"] == pytest.approx(chosen.step_time / without.step_time - 1)
    assert info["slowdown"] > 0 and info["stages"] == recomputing


def test_false_refuses_and_true_recomputes_every_stage() -> None:
    try:
        assert not planned(limit(), recompute=False).fits_memory
    except PartitionError as exc:
        assert "no placement fits" in str(exc)
    forced = planned(None, recompute=True)
    assert all(s.recompute for s in forced.stages)
    assert forced.options[KEY]["slowdown"] > 0
    assert not any(s.recompute for s in planned(None).stages)  # no limit: nothing to fit


def test_a_limit_no_plan_fits_names_the_least_memory_a_plan_needs() -> None:
    with pytest.raises(PartitionError, match=r"no plan fits .* the least a plan tried needs is"
                                             r" .* set by stage \d") as caught:  # fmt: skip
        planned(limit() / 2)
    message = str(caught.value)
    need = float(message.split(" B), on rank")[0].rsplit("(", 1)[1])
    assert need > limit() / 2
    assert planned(need).fits_memory  # what it names is enough


def test_memory_auto_is_the_available_ram_per_device_less_the_margin() -> None:
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if "MemAvailable" in line)
    cluster = limited(Cluster.parse("4@10GB/s"), "auto")
    assert cluster.memory == pytest.approx(available / 4 * (1 - MARGIN), rel=0.05)
    assert host_memory(2, total=80e9) == 80e9 * (1 - MARGIN)  # a device's own (compile: CUDA)
    assert limited(cluster, "16GB").memory == 16e9 and limited(cluster, None) is cluster
    with pytest.raises(PartitionError, match="memory must be"):
        limited(cluster, [1])
    with pytest.raises(PartitionError, match="recompute must be"):
        planned(None, recompute="yes")


def test_schedule_auto_weighs_recomputation_too() -> None:
    _, costs = _costs(CASE)
    chosen = pdcompile.plan(costs, "2", schedule="auto", num_microbatches=M, memory=limit())
    assert chosen.fits_memory and max(chosen.rank_memory) <= limit()
    assert any(row.get("fits_memory") for row in chosen.options["auto"])


def test_segments_follow_the_square_root_rule() -> None:
    """A stage of n computing nodes keeps about √n boundaries, nodes of its own."""
    _, costs = _costs(CASE)
    nodes = [n for n in costs.nodes if costs.graph.nodes[n]["kind"] == "compute"]
    boundaries = segment_boundaries(costs, nodes)
    assert 2 <= len(boundaries) + 1 <= int(len(nodes) ** 0.5) + 1
    members = {m for n in nodes for m in costs.graph.nodes[n]["members"]}
    assert set(boundaries) <= members


# -- 2 gloo ranks: compile(memory=) under the limit ------------------------------------------


def _train(rank: int, world_size: int, init_file: str, memory: float) -> tuple:
    init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    torch.set_num_threads(1)
    model, x, y, loss_fn, optimizer = CASES[CASE]()
    module = pdcompile.compile(
        model, (x,), example_targets=y, loss_fn=loss_fn, optimizer=optimizer, cluster="2",
        num_microbatches=M, profile=False, memory=memory, measure_memory=True, timeout=60,
    )  # fmt: skip
    inputs, targets = _batch(CASE)
    for _ in range(STEPS):
        module.train_step(inputs, targets)
    result = (module.plan, module.measured_memory, module.explain())
    dist.destroy_process_group()
    return result


def test_runs_fit_under_the_limit_as_predicted() -> None:
    chosen = planned(limit())
    per_rank = run_ranks(_train, 2, limit(), timeout_s=240)
    plan = per_rank[0][0]
    assert [s.nodes for s in plan.stages] == [s.nodes for s in chosen.stages]
    assert [s.recompute for s in plan.stages] == [s.recompute for s in chosen.stages]
    measured = {r: per_rank[r][1][r] for r in range(2)}
    for rank, c in memory_probe.compare(plan, measured).items():
        assert c.measured.peak.total < limit(), (rank, c.describe())
        assert abs(c.error) <= TOLERANCE, (rank, c.describe())
    text = per_rank[0][2]  # explain(): which stages recompute, and the slowdown
    assert recompute_table(plan) in text and "predicted slowdown" in text
    for s in plan.stages:
        form = "whole" if isinstance(s.recompute, bool) else f"{len(s.recompute)} boundar"
        assert (f"stage {s.index} {form}" in text) == bool(s.recompute), s.index
