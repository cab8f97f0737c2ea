"""A chunked plan gets its ranks x chunks stages even where the solver would use fewer
(`passes/planning/stage_split.py`): PipeDream's GNMT profile, whose heavy nodes bound every
cut, planned with two stages per rank under every kind that places them."""

from __future__ import annotations

import pytest

import pdcompile
from pdcompile import Cluster, CostGraph
from pdcompile.passes.planning.stage_split import split_to
from pdcompile.scheduling import get_schedule

GNMT = "tests/data/pipedream/gnmt/graph.txt"
CHUNKED = sorted(k for k in pdcompile.schedules() if get_schedule(k).default_chunks > 1)


@pytest.fixture(scope="module")
def gnmt() -> CostGraph:
    return CostGraph.from_pipedream(GNMT, batch_size=64)


def test_the_chunked_kinds_exist() -> None:
    assert {"interleaved-1f1b", "zb-v", "dualpipev", "v-half", "v-min"} <= set(CHUNKED)


@pytest.mark.parametrize("kind", CHUNKED)
def test_every_chunked_kind_plans_gnmt_with_two_stages_per_rank(gnmt, kind) -> None:
    rules = get_schedule(kind)
    plan = pdcompile.plan(gnmt, Cluster.parse("4@10GB/s"), schedule=kind, num_microbatches=8)
    assert plan.num_stages == 4 * rules.default_chunks
    assert sorted(r for s in plan.stages for r in s.ranks) == sorted(
        r for r in range(4) for _ in range(rules.default_chunks)
    )
    assert plan.step_time > 0


def test_splitting_keeps_the_nodes_in_order_and_never_raises_the_bottleneck(gnmt) -> None:
    one_each = pdcompile.plan(gnmt, "8", schedule="1f1b", replica_counts=[1])
    assert one_each.num_stages < 8  # the solver leaves devices unused: what is split
    split = split_to(one_each, 8, gnmt)
    times = dict(zip(gnmt.nodes, gnmt.compute_times(), strict=True))

    def bottleneck(plan: pdcompile.Plan) -> float:
        return max(sum(times[n] for n in s.nodes) for s in plan.stages)

    assert split.num_stages == 8
    assert [n for s in split.stages for n in s.nodes] == [
        n for s in one_each.stages for n in s.nodes
    ]
    assert [s.ranks for s in split.stages] == [(i,) for i in range(8)]
    assert bottleneck(split) <= bottleneck(one_each)


def test_fewer_nodes_than_stages_is_as_many_stages_as_nodes(gnmt) -> None:
    small = pdcompile.plan(gnmt, "2", schedule="1f1b", replica_counts=[1])
    assert split_to(small, 10**4, gnmt).num_stages == len(gnmt.nodes)
