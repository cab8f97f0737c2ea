"""One set of numbers: the closed forms as bounds on unequal and replicated stages (on equal ones,
every registered schedule's against simulating its own actions: test_schedule_conformance.py),
and `plan()`'s predictions against `simulate()` on a corpus of generated plans; the regressions
where the planner and the simulator used to disagree."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from schedule_kinds import builtin_kinds
from test_simulator import ACT, PARAM, WEIGHT, equal_plan
from test_solvers import random_dags

import pdcompile
from pdcompile import Cluster, CostGraph, Plan
from pdcompile.passes.planning.plans import consecutive_ranks
from pdcompile.runtime.local import LocalPipeline
from pdcompile.scheduling import get_schedule
from pdcompile.scheduling.action_kinds import FUSED

# random and small clusters give replica counts that do not divide the microbatches: the warning
# is not the point here (tests/test_replica_balance.py asserts it)
pytestmark = pytest.mark.filterwarnings("ignore::pdcompile.core.errors.PlanWarning")

# the fused kinds of one stage per rank (each checked on equal stages, its closed forms against
# its simulated actions, by tests/test_schedule_conformance.py)
FUSED_KINDS = builtin_kinds(
    lambda rules: rules.default_chunks == 1 and rules.compute_kinds == FUSED
)


def accepted(kind: str, replicas: list[int], m: int) -> int:
    return get_schedule(kind).accepted_microbatches(replicas, m)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[str, list[int], int, list[float], list[float]]:
    kind = draw(st.sampled_from(FUSED_KINDS))
    replicas = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    m = accepted(kind, replicas, draw(st.integers(1, 8)))
    times = st.lists(st.floats(0.1, 4.0), min_size=len(replicas), max_size=len(replicas))
    return kind, replicas, m, draw(times), draw(times)


@settings(deadline=None, max_examples=60)
@given(layouts())
def test_bounds_hold_on_unequal_and_replicated_stages(layout) -> None:
    """Off equal stages the closed forms are bounds: no stage does its work faster than its
    share of the call, and no rank holds more than the in-flight and stashing bounds."""
    kind, replicas, m, forwards, backwards = layout
    rules = get_schedule(kind)
    plan = equal_plan(replicas)
    plan = plan.with_(stages=tuple(
        dataclasses.replace(s, forward_s=f, backward_s=b)
        for s, f, b in zip(plan.stages, forwards, backwards, strict=True)
    ))  # fmt: skip
    sim = pdcompile.simulate(plan, schedule=kind, num_microbatches=m)
    for s, stage in enumerate(plan.stages):
        work = (stage.forward_s + stage.backward_s) * m / stage.replicas
        assert sim.time_per_step >= work * (1 - 1e-12)
        bound = (
            WEIGHT
            + rules.in_flight_bound(replicas, s, m) * ACT
            + rules.stashed_versions_bound(replicas, s, m) * PARAM
        )
        for rank in stage.ranks:
            assert sim.schedule_memory[rank] <= bound, (s, rank)


CLUSTERS = ["2", "3", "4", "4@10GB/s,2@1GB/s", "2@10GB/s,2@1GB/s"]


@st.composite
def corpora(draw: st.DrawFn) -> tuple[CostGraph, Cluster]:
    """A chain or DAG (`random_dags`) whose edges may carry no gradient, with an optional tied
    parameter, on a flat or 2-level cluster with or without heterogeneous speeds."""
    g = draw(random_dags())
    for u, v in g.graph.edges:
        g.graph.edges[u, v]["grad"] = draw(st.booleans())
    if draw(st.booleans()):  # a tensor the first and the last node share
        last = list(g.nodes)[-1]
        g.meta["ties"] = [{"nodes": ["n0", last], "grad_bytes": 64}]
        g.meta["param_tensors"] = dict.fromkeys(g.nodes, 1)
    text = draw(st.sampled_from(CLUSTERS))
    size = Cluster.parse(text).num_devices
    speed = draw(st.none() | st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=size,
                                      max_size=size))  # fmt: skip
    return g, Cluster.parse(text, speed=speed)


@settings(deadline=None, max_examples=40)
@given(corpus=corpora(), kind=st.sampled_from(FUSED_KINDS))
def test_plan_predictions_are_the_simulators(corpus, kind: str) -> None:
    g, cluster = corpus
    plan = pdcompile.plan(g, cluster, schedule=kind)
    sim = pdcompile.simulate(plan)
    assert plan.step_time == sim.time_per_step
    assert plan.rank_memory == tuple(sim.peak_memory)
    assert [s.memory_bytes for s in plan.stages] == sim.stage_memory
    prices = pdcompile.CostModel()
    for s in plan.stages:
        assert s.time_s == prices.stage_time(
            s.forward_s + s.backward_s, s.replicas, s.comm_s, s.allreduce_s
        )
    assert plan.predicted_time == max(s.time_s for s in plan.stages)
    assert plan.fits_memory


def replicated_plan(memory: float | None = None) -> tuple[Plan, CostGraph]:
    """Two stages, the second on three replicas: stage 0's warm-up is (1 + 3 - 1) // 1 = 3."""
    g = CostGraph(batch_size=4)
    g.add_node("a", forward_s=1.0, backward_s=2.0, param_bytes=100, activation_bytes=1000,
               output_bytes=10)  # fmt: skip
    g.add_node("b", forward_s=3.0, backward_s=6.0, param_bytes=100, activation_bytes=1000)
    g.add_edge("a", "b", 10)
    ranks = consecutive_ranks([1, 3])
    stages = tuple(
        pdcompile.Stage(index=i, nodes=(n,), replicas=len(r), ranks=r)
        for i, (n, r) in enumerate(zip("ab", ranks, strict=True))
    )
    cluster = Cluster([(4, 1e9)], memory=memory)
    return Plan(stages=stages, cluster=cluster, schedule="1f1b", num_microbatches=6), g


def test_a_replicated_later_stage_is_budgeted_the_activations_the_run_holds() -> None:
    """Regression: with replicas [1, 3] the simulator held 4 activations on stage 0 while the
    planner budgeted 2, so plans that did not fit were accepted."""
    plan, g = replicated_plan()
    scored = pdcompile.evaluate(plan, g)
    sim = pdcompile.simulate(scored)
    weights = scored.stages[0].weight_bytes
    assert scored.rank_memory == tuple(sim.peak_memory)
    assert sim.schedule_memory[0] == weights + 4 * 1000  # and the buffers of its messages
    assert scored.stages[0].memory_bytes == weights + 4 * 1000
    tight, _ = replicated_plan(memory=weights + 3 * 1000)
    assert not pdcompile.evaluate(tight, g).fits_memory
    for solver in ("dp", "cpsat"):  # the solvers' memory bounds are safe
        try:
            found = pdcompile.plan(g, tight.cluster, solver=solver, num_microbatches=6)
        except pdcompile.PartitionError:
            continue
        assert found.fits_memory, (solver, found)


class IntegerSkip(nn.Module):
    """Stage 2 reads an integer tensor stage 0 computed: no gradient goes back for it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(ids, dim=1)  # integer
        h = self.a(self.emb(ids)).mean(dim=1)
        return self.b(h) + order[:, :1].float()


def _grad_sends(events) -> int:
    return sum(1 for e in events if e.kind == "send" and e.peer >= 0 and e.microbatch >= 0)


def test_an_integer_channel_carries_no_gradient_in_simulation_or_at_run_time() -> None:
    """Regression: the simulator sent a gradient back on every channel with bytes, the runtime
    only on channels that require grad."""
    torch.manual_seed(0)
    model, ids = IntegerSkip(), torch.randint(0, 10, (8, 5))
    gm = pdcompile.trace(model, (ids,))
    costs = pdcompile.analyze(gm, (ids,), profile=False)
    names = list(costs.nodes)
    first = names.index("emb") + 1
    second = names.index("mean") + 1
    groups = [names[:first], names[first:second], names[second:]]
    stages = tuple(
        pdcompile.Stage(index=i, nodes=tuple(nodes), replicas=1, ranks=(i,))
        for i, nodes in enumerate(groups)
    )
    plan = pdcompile.evaluate(Plan(stages=stages, cluster=Cluster.parse("3")), costs)
    assert plan.edges[(0, 2)] is False and plan.edges[(1, 2)] is True
    program = pdcompile.codegen(gm, plan)
    sim = pdcompile.simulate(plan.with_(num_microbatches=2))
    simulated = [e for e in sim.timeline if e.kind == "send" and e.rank == 2]
    pipeline = LocalPipeline(
        program, schedule="1f1b", num_microbatches=2,
        loss_fn=lambda out, y: ((out - y) ** 2).mean(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )  # fmt: skip
    pipeline.workers[(2, 2)].timeline = []
    pipeline.train_step((ids,), torch.zeros(8, 1))
    measured = [e for e in pipeline.workers[(2, 2)].timeline if e.kind == "send"]
    assert sorted(e.peer for e in simulated) == sorted(e.peer for e in measured) == [1, 1]
