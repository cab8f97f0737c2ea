"""`schedule="synth"`: an order synthesised for the plan at hand (issue 34).

The kind's default orders go through every conformance check (tests/test_schedule_conformance.py
iterates the registry); here, the orders fitted to a plan: they beat 1F1B at no more memory on
PipeDream's GNMT profile, keep to a memory limit, travel in the plan (JSON, `Plan.rules`), and
train equal to gradient accumulation on the local executor and on 2 gloo ranks (the conformance
checks train each plan's own orders, `Plan.rules`).
"""

from __future__ import annotations

import warnings

import pytest
from test_schedule_conformance import mlp_program

import pdcompile
from pdcompile import Cluster, CostGraph, Plan
from pdcompile.runtime import validate_schedule
from pdcompile.scheduling import build_schedule, get_schedule
from pdcompile.scheduling.synth import Fitting, Knobs, Split, Synthesised

GNMT = "tests/data/pipedream/gnmt/graph.txt"


def _gnmt(schedule: str, memory: float | None = None) -> Plan:
    costs = CostGraph.from_pipedream(GNMT, batch_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pdcompile.plan(costs, Cluster.parse("8@10GB/s", memory=memory), schedule=schedule,
                              num_microbatches=16, replica_counts=[1])  # fmt: skip


def test_on_gnmt_it_beats_1f1b_at_no_more_memory_and_its_plan_carries_its_orders() -> None:
    base, synth = _gnmt("1f1b"), _gnmt("synth")
    assert synth.step_time < 0.95 * base.step_time
    assert max(synth.rank_memory) <= max(base.rank_memory)
    saved = synth.options["synth"]
    assert {"fitting", "recipe", "tried"} <= saved.keys() and len(saved["tried"]) > 10
    again = Plan.from_json(synth.to_json())
    assert again.rules.recipe == synth.rules.recipe and again.rules.fitting == synth.rules.fitting
    sim = pdcompile.simulate(again)  # the plan's own orders, not the kind's default
    assert sim.time_per_step == synth.step_time and tuple(sim.peak_memory) == synth.rank_memory
    assert pdcompile.simulate(again, schedule="synth").time_per_step != synth.step_time


def test_under_a_memory_limit_it_fits_without_recomputing_where_1f1b_cannot() -> None:
    free = _gnmt("1f1b")
    limit = 0.9 * max(free.rank_memory)
    plan = _gnmt("synth", memory=limit)
    assert plan.fits_memory and max(plan.rank_memory) <= limit
    assert plan.options["synth"]["fitting"]["budget"]  # the limit's budgets, per rank


@pytest.mark.parametrize(
    "recipe",
    [Knobs(), Knobs(forward_first=True, fill=1.0, cap=None, scale=2.0), Split((1, 0), (0, 1))],
)
def test_every_recipe_builds_orders_that_validate(recipe: Knobs | Split) -> None:
    fitting = Fitting(times=((1.0, 2.0, 0.5), (3.0, 1.0, 1.0)), message_s=(0.0, 0.2),
                      held=((4.0, 1.0), (2.0, 2.0)), budget={0: 8.0, 1: 4.0})  # fmt: skip
    rules = get_schedule("synth").fitted(fitting, recipe)
    schedule = build_schedule(rules, [(0,), (1,)], {(0, 1): True}, 6)
    validate_schedule(schedule)
    computes = [a for a in schedule.actions[1] if a.kind in ("F", "I", "W")]
    assert len(computes) == 18


def test_a_split_recipe_refuses_a_layout_it_was_not_made_for() -> None:
    rules = get_schedule("synth").fitted(Fitting(), Split((1, 0), (0, 1)))
    with pytest.raises(pdcompile.ScheduleError, match="plan again with schedule='synth'"):
        build_schedule(rules, [(0,), (1,), (0,)], {(0, 1): True, (1, 2): True}, 4)


def test_the_conformance_checks_train_the_plans_own_fitted_orders() -> None:
    """tests/test_schedule_conformance.py trains `program.plan.rules` locally and on 2 gloo
    ranks: for synth, the orders fitted to the MLP's plan, not the kind's default ones."""
    program, _ = mlp_program("synth")
    fitted, default = program.plan.rules, get_schedule("synth")
    assert isinstance(fitted, Synthesised) and fitted.fitting.times
    assert fitted.fitting != default.fitting
