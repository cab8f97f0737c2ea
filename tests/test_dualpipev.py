"""`dualpipev` (DeepSeek's DualPipeV) and the overlapped forward-backward pair (`FB`).

Pure tier: the orders are torch 2.13's `ScheduleDualPipeV`'s, action for action (torch's own
constructor, on stand-in stages: it needs no process group to compute `pipeline_order`), and it
accepts the microbatch counts torch does; a pair is built with its messages around it and
validated, a malformed one refused; the simulator prices a pair as max(F, B) + (1 -
fb_overlap) min(F, B); the closed forms equal the simulation and the walked orders on random
stage times. Single-process tier: a 1F1B whose steady pairs are overlapped trains equal to
gradient accumulation (the pair is no `dualpipev` feature). `dualpipev` itself trains equal to
gradient accumulation locally and on 2 gloo ranks through `tests/test_schedule_conformance.py`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pipeline_support import mlp_case
from test_schedule_conformance import (
    ACT,
    GRAD,
    SGD,
    WEIGHT,
    assert_trained,
    equal_plan,
    mlp_program,
)
from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _ComputationType

import pdcompile
from pdcompile import Cluster, PartitionError, ScheduleError
from pdcompile.core.cluster import RuntimeCosts
from pdcompile.pictures.gantt import plot_timelines
from pdcompile.runtime import validate_schedule
from pdcompile.runtime.local import LocalPipeline
from pdcompile.runtime.split_backward import backward_inputs
from pdcompile.scheduling import Action, Placement, Schedule, build_schedule, get_schedule
from pdcompile.scheduling.action_kinds import OVERLAP, RECV, SEND, B, F, I, W, overlapped
from pdcompile.scheduling.memory_walk import walks

KIND = "dualpipev"
RULES = get_schedule(KIND)
LETTERS = {_ComputationType.FORWARD: F, _ComputationType.FULL_BACKWARD: B,
           _ComputationType.BACKWARD_INPUT: I, _ComputationType.BACKWARD_WEIGHT: W}  # fmt: skip


def v_ranks(p: int) -> list[tuple[int]]:
    return [(RULES.chunk_rank(s, p, 2),) for s in range(2 * p)]


def chain(stages: int) -> dict[tuple[int, int], bool]:
    return {(s, s + 1): True for s in range(stages - 1)}


def torch_orders(p: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """torch's `pipeline_order` for p ranks and m microbatches, as pdcompile's order items
    (an `OVERLAP_F_B` as `overlapped` writes it), built by its own constructor on stand-in
    stages (what it reads of them: sizes, rank, no compiled module)."""
    orders = {}
    for rank in range(p):
        stages = [SimpleNamespace(group_size=p, group_rank=rank, num_stages=2 * p, submod=None,
                                  stage_index=s, is_first=s == 0, is_last=s == 2 * p - 1)
                  for s in (rank, 2 * p - 1 - rank)]  # fmt: skip
        items = []
        for a in ScheduleDualPipeV(stages, m).pipeline_order[rank]:
            if a.sub_actions:
                forward, backward = a.sub_actions
                items += overlapped((forward.stage_index, forward.microbatch_index),
                                    (backward.stage_index, backward.microbatch_index),
                                    LETTERS[backward.computation_type])  # fmt: skip
            else:
                items.append((LETTERS[a.computation_type], a.stage_index, a.microbatch_index))
        orders[rank] = items
    return orders


@pytest.mark.parametrize("p, m", [(1, 2), (1, 5), (2, 4), (2, 7), (3, 6), (3, 11), (4, 8), (4, 16)])
def test_the_orders_are_torchs(p: int, m: int) -> None:
    ours = RULES.rank_orders(Placement(tuple(v_ranks(p)), chain(2 * p), m))
    assert {rank: list(ours[rank]) for rank in range(p)} == torch_orders(p, m)


def test_it_accepts_the_counts_torch_accepts() -> None:
    """At least one microbatch per stage (2p on p ranks), 2p stages in a V."""
    for p in (1, 2, 3):
        for m in range(1, 2 * p + 2):
            assert RULES.accepts([1] * 2 * p, m) == (m >= 2 * p), (p, m)
        with pytest.raises(ValueError, match="at least as many microbatches as stages"):
            torch_orders(p, 2 * p - 1)
    with pytest.raises(ScheduleError, match="at least 2p microbatches"):
        build_schedule(KIND, v_ranks(2), chain(4), 3)
    with pytest.raises(ScheduleError, match="in a V"):
        build_schedule(KIND, [(0,), (1,), (0,), (1,)], chain(4), 4)
    assert RULES.accepted_microbatches([1] * 8, 1) == 8


def test_a_pair_brings_both_messages_around_it() -> None:
    """Both receives before the bracket, its forward then its backward, both sends after."""
    schedule = build_schedule(KIND, v_ranks(2), chain(4), 4)
    validate_schedule(schedule)
    actions = schedule.actions[1]
    i = next(i for i, a in enumerate(actions) if a.kind == OVERLAP)
    assert [a.kind for a in actions[i - 2 : i + 5]] == [RECV, RECV, OVERLAP, F, B, SEND, SEND]
    forward, backward = actions[i + 1], actions[i + 2]
    assert actions[i][:3] == (OVERLAP, forward.stage, forward.microbatch)
    assert {a.stream for a in actions[i - 2 : i]} == {"act", "grad"}
    assert str(actions[i]) == "FB" and forward.microbatch != backward.microbatch


def test_a_malformed_pair_is_refused() -> None:
    """By the builder (an order whose bracket is not followed by its parts) and the validator
    (actions that separate them)."""

    class Swapped(type(RULES)):
        name = "swapped"

        def rank_orders(self, placement: Placement) -> Mapping[int, Sequence[tuple]]:
            orders = super().rank_orders(placement)
            return {r: _swap_first_pair(list(order)) for r, order in orders.items()}

    with pytest.raises(ScheduleError, match="must be followed by its forward"):
        build_schedule(Swapped(), v_ranks(2), chain(4), 4)
    schedule = build_schedule(KIND, v_ranks(2), chain(4), 4)
    actions = list(schedule.actions[0])
    i = actions.index(next(a for a in actions if a.kind == OVERLAP))
    actions.insert(i + 1, actions.pop(i + 2))  # the backward before the forward
    broken = Schedule(
        KIND, 4, schedule.replicas, schedule.ranks, {**schedule.actions, 0: tuple(actions)}
    )
    with pytest.raises(ScheduleError, match="overlapped pair at step"):
        validate_schedule(broken)


def _swap_first_pair(order: list[tuple]) -> list[tuple]:
    i = next((i for i, item in enumerate(order) if item[0] == OVERLAP), None)
    if i is not None:
        order[i + 1], order[i + 2] = order[i + 2], order[i + 1]
    return order


def simulate(p: int, m: int, f: float, i: float, w: float, fb_overlap: float = 0.0):  # noqa: ANN201
    plan = equal_plan(v_ranks(p), f, i, w)
    cluster = Cluster([(p, 1e30)], runtime=RuntimeCosts(fb_overlap=fb_overlap))
    return pdcompile.simulate(plan, schedule=KIND, num_microbatches=m, cluster=cluster)


@pytest.mark.parametrize("fb_overlap", [0.0, 0.25, 1.0])
def test_the_simulator_hides_the_overlapped_share_of_a_pair(fb_overlap: float) -> None:
    """Each pair's forward and backward take max(F, B) + (1 - fb_overlap) min(F, B), the
    backward shortened; overlap 0 is the closed form of the pairs run one after the other."""
    f, i, w = 0.7, 1.3, 0.4
    sim = simulate(3, 8, f, i, w, fb_overlap)
    b = i + w
    pairs = 0
    for rank in range(3):
        events = [e for e in sim.timeline if e.rank == rank]
        for j, e in enumerate(events):
            if e.kind == OVERLAP:
                forward, backward = events[j + 1], events[j + 2]
                assert (forward.kind, backward.kind, forward.start) == (F, B, e.start)
                took = backward.end - forward.start
                assert took == pytest.approx(max(f, b) + (1 - fb_overlap) * min(f, b))
                pairs += 1
    assert pairs == sum(a.kind == OVERLAP for acts in sim.schedule.actions.values() for a in acts)
    sequential = RULES.step_time(6, 8, f, b, weight_s=w, chunks=2)
    if fb_overlap == 0:
        assert sim.time_per_step == pytest.approx(sequential, rel=1e-12)
    else:
        assert sim.time_per_step < sequential


def test_the_overlap_is_a_share() -> None:
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(PartitionError, match="fb_overlap must be a share from 0 to 1"):
            RuntimeCosts(fb_overlap=bad)
    cluster = Cluster([(2, 1e9)], runtime=RuntimeCosts(fb_overlap=0.5))
    assert Cluster.from_dict(cluster.to_dict()).runtime.fb_overlap == 0.5


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 16])
def test_the_closed_forms_are_the_simulated_step_and_the_walked_memory(p: int) -> None:
    """Random stage times, M = 2p and 4p (and 2p + 1): the step time and bubble equal the
    simulation, and every rank holds 2p + 1 microbatch-chunks, simulated and walked."""
    rng = random.Random(p)
    for m in (2 * p, 2 * p + 1, 4 * p):
        f, i, w = (rng.uniform(0.1, 3.0) for _ in range(3))
        sim = simulate(p, m, f, i, w)
        step = RULES.step_time(2 * p, m, f, i + w, weight_s=w, chunks=2)
        assert sim.time_per_step == pytest.approx(step, rel=1e-12), (m, f, i, w)
        bubble = RULES.bubble(2 * p, m, f, i + w, weight_s=w, chunks=2)
        assert sim.bubble_fraction == pytest.approx([bubble] * p, rel=1e-9)
        held = [(peak - 2 * (WEIGHT - GRAD)) // ACT for peak in sim.schedule_memory]
        walked = [w.in_flight for w in walks(RULES, (1,) * 2 * p, m, 2)]
        assert held == walked[:p] == [RULES.in_flight_bound([1] * 2 * p, 0, m, chunks=2)] * p
        assert held[0] == 2 * p + 1
    # DeepSeek's bubble, (PP/2 - 1)(F&B + B - 3W) on PP = 2p stages, where it is exact: F = I = W
    sim = simulate(p, 2 * p, 1.0, 1.0, 1.0)
    assert sim.time_per_step - 2 * 2 * p * 3.0 == pytest.approx((p - 1) * (3 + 2 - 3))


class Overlapped1F1B(type(get_schedule("1f1b"))):
    """1F1B with each steady forward and the backward after it run as an overlapped pair."""

    name = "1f1b-overlapped"

    def rank_orders(self, placement: Placement) -> Mapping[int, Sequence[tuple]]:
        orders = super().rank_orders(placement)
        return {rank: _paired(list(orders[rank])) for rank in placement.world}


def _paired(order: list[tuple]) -> list[tuple]:
    out, t = [], 0
    while t < len(order):
        if order[t][0] == F and t + 1 < len(order) and order[t + 1][0] == B:
            out += overlapped(order[t][1:], order[t + 1][1:])
            t += 2
        else:
            out.append(order[t])
            t += 1
    return out


def test_any_order_may_overlap_pairs_and_trains_equal_to_gradient_accumulation() -> None:
    """Pairs on one stage per rank (as torch's CSV may write them) build, validate, and train
    the MLP equal to gradient accumulation on the local executor; drawn outlined."""
    rules = Overlapped1F1B()
    program, m = mlp_program("1f1b")
    ranks = [s.ranks for s in program.plan.stages]
    schedule = build_schedule(rules, ranks, program.plan.edges, m)
    validate_schedule(schedule)
    assert any(a.kind == OVERLAP for a in schedule.actions[0])
    _, x, y, loss_fn = mlp_case()
    pipeline = LocalPipeline(program, schedule=rules, num_microbatches=m, loss_fn=loss_fn,
                             optimizer=SGD)  # fmt: skip
    for _ in range(3):
        pipeline.train_step((x,), y)
    params = {n: p for st in pipeline.stage_modules().values()
              for n, p in st.named_parameters(remove_duplicate=False)}  # fmt: skip
    assert_trained(params, m, rules.name)


def test_a_pair_is_outlined_in_gantt_charts(tmp_path: Path) -> None:
    sim = simulate(2, 4, 1.0, 1.0, 0.5, fb_overlap=0.5)
    target = tmp_path / "dualpipev.svg"
    plot_timelines([("dualpipev", sim.timeline)], target)
    assert "overlapped forward and backward" in target.read_text()


def test_an_action_stays_small() -> None:
    """The pair adds no field to `Action`: a bracket is one more action per pair."""
    assert Action._fields == ("kind", "stage", "microbatch", "peer", "peer_stage", "stream",
                              "group", "tie")  # fmt: skip


def test_a_split_stage_that_passes_its_input_on_sends_its_gradient_back() -> None:
    """A stage of Dropout(0) alone returns its input tensor itself: I gives the input the
    gradient that came back (it was lost, and the MLP cut in 8 trained wrong under every split
    schedule on 4 ranks)."""
    x = torch.randn(3, requires_grad=True)
    out = torch.nn.functional.dropout(x, 0.0, training=True)
    assert out is x
    (found,), _ = backward_inputs([out], [torch.full((3,), 2.0)], [x], [])
    assert torch.equal(found, torch.full((3,), 2.0))
