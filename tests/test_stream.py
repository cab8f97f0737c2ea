"""The endless stream of the streaming schedules, unfolded as walked, against the built schedules
(pure, torch-free)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.core.errors import ScheduleError
from pdcompile.passes.planning.plans import consecutive_ranks
from pdcompile.runtime.pipeline import cuts
from pdcompile.runtime.stream import RankStream
from pdcompile.scheduling import build_schedule, get_schedule, replica_orders
from pdcompile.scheduling.builder import Layout


@st.composite
def streaming_pipelines(draw):
    kind = draw(st.sampled_from(["pipedream", "2bw"]))
    stages = draw(st.integers(1, 4))
    replicas = draw(st.lists(st.integers(1, 3), min_size=stages, max_size=stages))
    edges = {(s, s + 1): True for s in range(stages - 1)}
    if stages > 2 and draw(st.booleans()):
        edges[(0, stages - 1)] = draw(st.booleans())  # a skip connection, with or without grads
    lcm = math.lcm(*replicas)
    least = lcm * -(-stages // lcm) if kind == "2bw" else lcm  # 2bw: M >= stages
    m = least * draw(st.integers(1, 3))
    tieable = stages > 1 and (kind == "2bw" or replicas[0] == replicas[-1] == 1)
    ties = [(0, stages - 1)] if tieable and draw(st.booleans()) else []
    clip = draw(st.booleans())
    return kind, consecutive_ranks(replicas), edges, m, ties, clip


def streams(kind, ranks, edges, m, ties, clip) -> dict[int, RankStream]:
    layout = Layout(ranks, edges, m, ties, clip)
    orders = {r: o for (r, _), o in replica_orders(get_schedule(kind), layout).items()}
    return {rank: RankStream(order) for rank, order in orders.items()}


@settings(max_examples=60, deadline=None)
@given(streaming_pipelines(), st.integers(1, 4))
def test_walked_stream_and_its_drain_are_the_built_schedule(pipeline, steps) -> None:
    """Walking the stream call by call (cut, release) and draining it after `steps` calls gives
    every rank exactly the actions of the schedule built for `steps` steps."""
    kind, ranks, edges, m, ties, clip = pipeline
    built = build_schedule(kind, ranks, edges, m, ties, clip, num_steps=steps)
    stream = streams(kind, ranks, edges, m, ties, clip)
    walked = {rank: [] for rank in stream}
    position = dict.fromkeys(stream, 0)
    for call in range(1, steps + 1):
        stop = cuts(stream, call * m, position)
        for rank, s in stream.items():
            walked[rank] += s[position[rank] : stop[rank]]
            s.release(stop[rank])
        position = stop
    for rank, s in stream.items():
        assert tuple(walked[rank]) + s.drain(position[rank], steps * m) == built.actions[rank]


def test_a_long_stream_keeps_a_bounded_number_of_actions() -> None:
    """500 calls of a 4-stage `pipedream` pipeline with a replicated stage: each rank holds a
    few items of actions, and the drain still ends the stream as the built schedule does."""
    ranks, edges, m = consecutive_ranks([1, 2, 1, 1]), {(s, s + 1): True for s in range(3)}, 4
    stream = streams("pipedream", ranks, edges, m, [], False)
    position = dict.fromkeys(stream, 0)
    most = 0
    for call in range(1, 501):
        position = cuts(stream, call * m, position)
        for rank, s in stream.items():
            s.release(position[rank])
            most = max(most, s.kept)
    assert most <= 3 * len(build_schedule("pipedream", ranks, edges, m).actions[0])
    built = build_schedule("pipedream", ranks, edges, m, num_steps=500)
    for rank, s in stream.items():
        assert s.drain(position[rank], 500 * m) == built.actions[rank][position[rank] :]
    with pytest.raises(ScheduleError, match="was released"):
        stream[0][0]
    with pytest.raises(ScheduleError, match="start and a stop"):
        stream[0][position[0] :]
