"""Schedules as data: versions, builders, and the validator (pure, torch-free)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile.core.errors import ScheduleError
from pdcompile.runtime import validate_schedule
from pdcompile.scheduling import Action, Schedule, build_schedule, get_schedule
from pdcompile.scheduling.builder import compute_order, tie_components
from pdcompile.scheduling.pipedream import version, vertical_version
from pdcompile.scheduling.two_bw import two_bw_version


def warmup(replicas: list[int], stage: int) -> int:
    return get_schedule("pipedream").warmup(replicas, stage, 1)


def two_bw_warmup(replicas: list[int], stage: int, num_microbatches: int) -> int:
    return get_schedule("2bw").warmup(replicas, stage, num_microbatches)


def layout(replicas):
    ranks, next_rank = [], 0
    for r in replicas:
        ranks.append(tuple(range(next_rank, next_rank + r)))
        next_rank += r
    return ranks


def chain_edges(stages, skips=()):
    edges = {(s, s + 1): True for s in range(stages - 1)}
    edges.update({pair: True for pair in skips})
    return edges


# -- versions ------------------------------------------------------------------------------


def test_straight_pipeline_versions_are_k_minus_stages_after() -> None:
    replicas = [1, 1, 1, 1]
    assert [warmup(replicas, s) for s in range(4)] == [3, 2, 1, 0]
    for s in range(4):
        for k in range(10):
            assert version(replicas, s, k) == max(0, k - (3 - s))


def test_replicated_versions_follow_pipedreams_rule() -> None:
    replicas = [2, 1]  # 3 ranks as 2-1: w_0 = (3 - 1) // 2 = 1, w_1 = 0
    assert warmup(replicas, 0) == 1 and warmup(replicas, 1) == 0
    assert [version(replicas, 0, k) for k in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert [version(replicas, 1, k) for k in range(4)] == [0, 1, 2, 3]
    # vertical sync: stage 1 uses only updates from minibatches stage 0's weights include
    assert [vertical_version(replicas, 1, k) for k in range(8)] == [0, 0, 0, 0, 2, 2, 4, 4]


def test_two_bw_versions_lag_one_step_and_its_warmup_is_capped() -> None:
    # step t = k // M computes on W(t - 1), the first two steps on W(0)
    assert [two_bw_version(3, k) for k in range(12)] == [0] * 6 + [1] * 3 + [2] * 3
    assert [two_bw_version(3, k, first_step=2) for k in range(6)] == [1] * 3 + [2] * 3
    assert [two_bw_warmup([1, 1, 1, 1], s, 4) for s in range(4)] == [3, 2, 1, 0]
    # 2-1 with M = 2: w_0 = 1 <= M // r_0 = 1; 3-3-3 with M = 3: w_0 = 2 capped at 3 // 3 = 1
    assert two_bw_warmup([2, 1], 0, 2) == 1 and two_bw_warmup([3, 3, 3], 0, 3) == 1
    with pytest.raises(ScheduleError, match="num_microbatches >= 1"):
        two_bw_version(0, 1)


def test_bad_layouts_are_schedule_errors() -> None:
    with pytest.raises(ScheduleError, match="replica counts must be >= 1"):
        build_schedule("1f1b", [(0,), ()], chain_edges(2), 2)
    with pytest.raises(ScheduleError, match="stage 3 does not exist"):
        version([1, 1], 3, 0)
    with pytest.raises(ScheduleError, match="at least as many microbatches as stages"):
        build_schedule("2bw", layout([1, 1, 1]), chain_edges(3), 2)
    with pytest.raises(ScheduleError, match="every replica count divides"):
        build_schedule("pipedream", layout([2, 1]), chain_edges(2), 3)
    with pytest.raises(ScheduleError, match="2bw streams steps, so every replica"):
        build_schedule("2bw", layout([2, 1]), chain_edges(2), 3)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        build_schedule("zb", layout([1]), {}, 2)
    with pytest.raises(ScheduleError, match="tied tensor on a replicated stage"):
        build_schedule("pipedream", layout([2, 1]), chain_edges(2), 2, ties=[(0, 1)])
    with pytest.raises(ScheduleError, match="must flow to a later stage"):
        build_schedule("1f1b", layout([1, 1]), {(1, 0): True}, 2)
    with pytest.raises(ScheduleError, match="only streaming schedules"):
        build_schedule("1f1b", layout([1, 1]), chain_edges(2), 2, num_steps=2)


# -- builders ------------------------------------------------------------------------------


def test_one_f_one_b_order_on_the_first_of_four_stages() -> None:
    assert compute_order("1f1b", 3, [0, 1, 2, 3, 4]) == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1), ("B", 2),
        ("B", 3), ("B", 4),
    ]  # fmt: skip
    assert compute_order("gpipe", 3, [0, 1]) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@st.composite
def pipelines(draw):
    stages = draw(st.integers(1, 4))
    replicas = draw(st.lists(st.integers(1, 3), min_size=stages, max_size=stages))
    skips = draw(
        st.sets(st.tuples(st.integers(0, 3), st.integers(0, 3)).filter(
            lambda p: p[0] + 1 < p[1] < stages
        ))
    )  # fmt: skip
    kind = draw(st.sampled_from(["1f1b", "gpipe", "pipedream", "2bw"]))
    lcm = 1
    for r in replicas:
        lcm = lcm * r // __import__("math").gcd(lcm, r)
    least = -(-stages // lcm) if kind == "2bw" else 1  # 2bw: at least as many as stages
    streaming = kind in ("pipedream", "2bw")
    m = lcm * draw(st.integers(least, least + 2)) if streaming else draw(st.integers(stages, 9))
    steps = draw(st.integers(1, 3)) if streaming else 1
    tie = st.sets(st.integers(0, stages - 1), min_size=2)
    ties = draw(st.lists(tie, max_size=2)) if stages > 1 else []
    if kind == "pipedream":  # tied stages of pipedream have one replica each
        ties = [t for t in ties if all(replicas[s] == 1 for s in t)]
    return kind, replicas, chain_edges(stages, skips), m, ties, steps, draw(st.booleans())


@settings(deadline=None, max_examples=150)
@given(pipelines())
def test_every_built_schedule_validates(pipeline) -> None:
    kind, replicas, edges, m, ties, steps, clip = pipeline
    schedule = build_schedule(kind, layout(replicas), edges, m, ties, clip, num_steps=steps)
    validate_schedule(schedule)
    linked = tie_components(len(replicas), ties)
    for rank, actions in schedule.actions.items():  # a clip before every update
        stage = schedule.stages_of(rank)[0]
        clips = [a for a in actions if a.kind == "clip"]
        assert len(clips) == (sum(a.kind == "step" for a in actions) if clip else 0)
        if kind == "pipedream":  # per stage, or with the stages tied to it
            tied = sorted(r for s in linked[stage] for r in schedule.ranks[s])
            assert {a.group for a in clips} <= {tuple(tied) if len(linked[stage]) > 1 else ()}
    computed = sorted(
        (a.stage, a.microbatch)
        for actions in schedule.actions.values()
        for a in actions
        if a.kind == "F"
    )
    assert computed == sorted((s, k) for s in range(len(replicas)) for k in range(m * steps))
    for rank, actions in schedule.actions.items():  # one update per round, step or call
        r = replicas[schedule.stages_of(rank)[0]]
        rounds = {"pipedream": m * steps // r, "2bw": steps}.get(kind, 1)
        assert sum(a.kind == "step" for a in actions) == rounds, rank


@settings(deadline=None, max_examples=60)
@given(pipelines().filter(lambda p: p[0] == "pipedream"))
def test_pipedream_order_realises_the_version_function(pipeline) -> None:
    """Counting a replica's updates before each forward gives v(k, s) exactly; a stream of
    several steps is the schedule of all their minibatches at once."""
    _, replicas, edges, m, ties, steps, _ = pipeline
    schedule = build_schedule("pipedream", layout(replicas), edges, m * steps, ties)
    streamed = build_schedule("pipedream", layout(replicas), edges, m, ties, num_steps=steps)
    assert streamed == schedule
    for rank, actions in schedule.actions.items():
        (stage,) = schedule.stages_of(rank)
        steps = 0
        for a in actions:
            if a.kind == "step":
                steps += 1
            elif a.kind == "F":
                assert steps == version(replicas, stage, a.microbatch), (rank, a)


@settings(deadline=None, max_examples=80)
@given(pipelines().filter(lambda p: p[0] == "2bw"))
def test_two_bw_streams_updates_once_per_step_on_two_versions(pipeline) -> None:
    """Replaying each replica: every replica makes one update per step, after its backwards of
    that step; the weights each forward needs, W(u) with u = two_bw_version, are the live ones
    (u updates made) or the one stashed version before them (u + 1 made); the versions that
    microbatches in flight use, with the live one, are at most two."""
    _, replicas, edges, m, ties, steps, _ = pipeline
    schedule = build_schedule("2bw", layout(replicas), edges, m, ties, num_steps=steps)
    for rank, actions in schedule.actions.items():
        updates, in_flight = 0, {}
        for a in actions:
            if a.kind == "step":
                assert a.microbatch == updates, (rank, a)
                assert all(k // m > updates for k in in_flight), (rank, a)  # its step is done
                updates += 1
            elif a.kind == "push":
                in_flight[a.microbatch] = two_bw_version(m, a.microbatch)
                assert updates - in_flight[a.microbatch] in (0, 1), (rank, a)
                assert a.microbatch // m >= updates, (rank, a)  # its step's update is to come
            elif a.kind == "pop":
                del in_flight[a.microbatch]
            assert len({*in_flight.values(), updates}) <= 2, (rank, a)
        assert updates == steps and not in_flight


def test_two_bw_steps_overlap_without_draining() -> None:
    """Over two steps of a straight pipeline, every stage with a warm-up runs its w_s warm-up
    forwards of step 1 before its update 0 (1f1b drains first); one step alone is 1f1b's order
    with stashing."""
    ranks, edges, m = layout([1, 1, 1, 1]), chain_edges(4), 4
    stream = build_schedule("2bw", ranks, edges, m, num_steps=2)
    validate_schedule(stream)
    for rank, actions in stream.actions.items():
        kinds = [(a.kind, a.microbatch) for a in actions]
        ahead = [k for kind, k in kinds[: kinds.index(("step", 0))] if kind == "F" and k >= m]
        assert ahead == list(range(m, m + 3 - rank))  # w_s = S - 1 - s
    one = build_schedule("2bw", ranks, edges, m)
    synchronous = build_schedule("1f1b", ranks, edges, m)
    for rank, actions in one.actions.items():
        assert [str(a) for a in actions if a.kind not in ("push", "pop")] == [
            str(a) if a.kind != "step" else "step0" for a in synchronous.actions[rank]
        ]


def test_one_f_one_b_keeps_at_most_warmup_plus_one_in_flight() -> None:
    schedule = build_schedule("1f1b", layout([1, 1, 1, 1]), chain_edges(4), 8)
    for rank, actions in schedule.actions.items():
        live = peak = 0
        for a in actions:
            live += {"F": 1, "B": -1}.get(a.kind, 0)
            peak = max(peak, live)
        assert peak == 4 - rank
    gpipe = build_schedule("gpipe", layout([1, 1]), chain_edges(2), 8)
    assert [a.kind for a in gpipe.actions[0] if a.kind in ("F", "B")] == ["F"] * 8 + ["B"] * 8


# -- the validator catches broken schedules -------------------------------------------------


def _edit(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    return replace(schedule, actions={**schedule.actions, rank: tuple(actions)})


def test_a_missing_receive_is_named_with_the_grid() -> None:
    schedule = build_schedule("1f1b", layout([1, 1]), chain_edges(2), 2)
    actions = [a for a in schedule.actions[1] if not (a.kind == "recv" and a.microbatch == 1)]
    with pytest.raises(ScheduleError, match=r"message act1 from rank 0 to rank 1: 1 sends, 0 rec"):
        validate_schedule(_edit(schedule, 1, actions))


def test_a_deadlock_is_found_and_marked() -> None:
    schedule = build_schedule("1f1b", layout([1, 1]), chain_edges(2), 2)
    # rank 0 waits for the gradient of microbatch 0 before sending its activation
    actions = list(schedule.actions[0])
    send = next(i for i, a in enumerate(actions) if a.kind == "send")
    recv = next(i for i, a in enumerate(actions) if a.kind == "recv")
    actions.insert(send, actions.pop(recv))
    with pytest.raises(ScheduleError, match="deadlock: rank 0 at grad0<1, rank 1 at act0<0") as e:
        validate_schedule(_edit(schedule, 0, actions))
    assert "!grad0<1" in str(e.value) and "!act0<0" in str(e.value)


def test_backward_before_forward_and_foreign_stages_are_refused() -> None:
    schedule = build_schedule("gpipe", layout([1, 1]), chain_edges(2), 1)
    actions = list(schedule.actions[1])
    f = next(i for i, a in enumerate(actions) if a.kind == "F")
    b = next(i for i, a in enumerate(actions) if a.kind == "B")
    actions[f], actions[b] = actions[b], actions[f]
    with pytest.raises(ScheduleError, match="rank 1 runs B0 before F0"):
        validate_schedule(_edit(schedule, 1, actions))
    with pytest.raises(ScheduleError, match="rank 0 runs stage 1 at step 0"):
        validate_schedule(_edit(schedule, 0, [Action("F", 1, 0)]))
