"""A schedule a test file defines by its orders alone, without editing the package.

`bfs-from-a-test-file` (looped breadth-first, Lamy-Poirier, 2023; the package's own is
`looped-bfs`, which runs the backwards in torch's order) runs, on each rank,
every microbatch through the rank's first stage, then through its next, and so on (its stages
placed round-robin: the package's default placement), then the backwards the same way from its
last stage down: GPipe on each of a rank's stages in turn. It gives only `rank_orders`: no
placement, no accepted counts, no weight policy, no closed forms. It plans, simulates,
validates and trains equal to gradient accumulation, locally and on 2 gloo ranks, through the
conformance checks every registered schedule passes (`tests/test_schedule_conformance.py`);
its memory counts are walked off its orders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
from test_schedule_conformance import (
    check_closed_forms,
    check_gloo_training,
    check_local_training,
    check_memory_counts,
    check_orders,
)

import pdcompile
from pdcompile.runtime import validate_schedule
from pdcompile.scheduling import PipelineSchedule, Placement, build_schedule, register_schedule


@register_schedule("bfs-from-a-test-file")
class LoopedBreadthFirst(PipelineSchedule):
    """Looped breadth-first: every microbatch through a rank's stage before its next stage."""

    def rank_orders(self, placement: Placement) -> Mapping[int, Sequence[tuple[str, int, int]]]:
        orders = {}
        for rank in placement.world:
            stages = placement.stages_of(rank)
            forwards = [("F", s, k) for s in stages for k in placement.mine(rank, s)]
            backwards = [("B", s, k) for s in reversed(stages) for k in placement.mine(rank, s)]
            orders[rank] = forwards + backwards
        return orders


KIND = "bfs-from-a-test-file"


def test_it_is_listed_and_its_orders_are_breadth_first() -> None:
    assert pdcompile.schedules()[KIND].startswith("Looped breadth-first")
    ranks = [(0,), (1,), (0,), (1,)]  # 4 stages on 2 ranks, round-robin
    schedule = build_schedule(KIND, ranks, {(s, s + 1): True for s in range(3)}, 2)
    validate_schedule(schedule)
    computes = [f"{a}@{a.stage}" for a in schedule.actions[0] if a.kind in ("F", "B")]
    assert computes == ["F0@0", "F1@0", "F0@2", "F1@2", "B0@2", "B1@2", "B0@0", "B1@0"]


def test_its_orders_build_and_validate_on_every_layout() -> None:
    assert check_orders(KIND) > 10


def test_it_plans_and_simulates_with_chunks_and_its_memory_is_walked() -> None:
    costs = pdcompile.CostGraph.load("docs/pictures/chain8.json")  # 8 equal layers
    plan = pdcompile.plan(costs, "4", solver="uniform", schedule=KIND, chunks=2)
    assert [s.ranks[0] for s in plan.stages] == [0, 1, 2, 3] * 2
    sim = pdcompile.simulate(plan)
    assert plan.step_time == sim.time_per_step and plan.rank_memory == tuple(sim.peak_memory)
    rules = pdcompile.scheduling.get_schedule(KIND)
    assert rules.closed_forms is None and check_closed_forms(KIND) == 0
    # GPipe's order on each stage: every microbatch of the replica in flight
    assert [rules.in_flight_bound([1] * 4, s, 8) for s in range(4)] == [8] * 4
    assert rules.in_flight_bound([1] * 8, 0, 8, chunks=2) == 16  # both stages of the rank
    assert check_memory_counts(KIND) > 0


@pytest.mark.parametrize("chunks", [1, 2])
def test_it_trains_equal_to_gradient_accumulation_locally(chunks: int) -> None:
    check_local_training(KIND, chunks)


@pytest.mark.timeout(180)
def test_it_trains_equal_to_gradient_accumulation_on_two_gloo_ranks() -> None:
    check_gloo_training([(KIND, 1), (KIND, 2)])
