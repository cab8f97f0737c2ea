"""`ideal` and `cpsat` against brute force under `evaluate`, against `dp`, and their fallbacks."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_solvers import chain

import pdcompile
from pdcompile import Cluster, CostGraph, PartitionError, Plan, Stage, evaluate
from pdcompile.core.message_buffers import stage_bytes
from pdcompile.passes.planning.evaluation import price
from pdcompile.passes.planning.plans import consecutive_ranks
from pdcompile.scheduling import get_schedule

# random and small clusters give replica counts that do not divide the microbatches: the warning
# is not the point here (tests/test_replica_balance.py asserts it)
pytestmark = pytest.mark.filterwarnings("ignore::pdcompile.core.errors.PlanWarning")

SCHEDULES = ("1f1b", "gpipe", "pipedream", "2bw")
DATA = Path(__file__).parent / "data" / "pipedream"


def dag(n: int, edges: list[bool], costs: list[tuple], source: bool) -> CostGraph:
    """`n` nodes, edge i -> j (i < j) where the next flag says so; node 0 a data source."""
    g = CostGraph(batch_size=8)
    for i, (t, p, a) in enumerate(costs[:n]):
        kind = "input" if source and i == 0 else "compute"
        g.add_node(f"n{i}", kind=kind, forward_s=t / 3, backward_s=2 * t / 3, param_bytes=p,
                   grad_bytes=p, activation_bytes=a)  # fmt: skip
    flags = iter(edges)
    for j in range(1, n):
        for i in range(j):
            if next(flags):
                g.add_edge(f"n{i}", f"n{j}", 10 * (i + 1) + j)
    return g


def ideals(g: CostGraph) -> list[frozenset[str]]:
    out = []
    for k in range(len(g.nodes) + 1):
        for subset in map(frozenset, itertools.combinations(g.nodes, k)):
            if all(p in subset for n in subset for p in g.graph.predecessors(n)):
                out.append(subset)
    return out


def brute_force(g: CostGraph, cluster: Cluster, schedule: str, m: int) -> float:
    """The best predicted time that fits memory (`fits`) over every chain of ideals (data
    sources in the first stage) and every replica assignment the schedule accepts with m
    microbatches, each plan priced (`evaluation.price`)."""
    kinds = g.graph.nodes
    sources = {n for n in g.nodes if kinds[n]["kind"] == "input" and g.graph.in_degree(n) == 0}
    downsets, everything, d = ideals(g), frozenset(g.nodes), cluster.num_devices
    rules = get_schedule(schedule)

    def chains(done: frozenset[str], stages: list[frozenset[str]]):
        if done == everything:
            yield stages
        elif len(stages) < d:
            for ideal in downsets:
                if done < ideal and (done or sources <= ideal):
                    yield from chains(ideal, [*stages, ideal - done])

    best = math.inf
    for stages in chains(frozenset(), []):
        for replicas in itertools.product(range(1, d + 1), repeat=len(stages)):
            if sum(replicas) > d:
                continue
            ranks = consecutive_ranks(replicas)
            plan = Plan(
                stages=tuple(
                    Stage(index=i, nodes=tuple(n for n in g.nodes if n in s), replicas=r,
                          ranks=ranks[i])
                    for i, (s, r) in enumerate(zip(stages, replicas, strict=True))
                ),  # fmt: skip
                cluster=cluster, schedule=schedule, num_microbatches=m,
            )  # fmt: skip
            if not rules.accepts(replicas, m):
                continue
            scored = price(plan, g)
            if fits(scored, rules, m):
                best = min(best, scored.predicted_time)
    return best


def streamable(schedule: str, m: int, cluster: Cluster) -> int:
    """`m`, or for 2bw (which needs at least as many microbatches as stages) the devices."""
    return max(m, cluster.num_devices) if schedule == "2bw" else m


def fits(plan: Plan, rules, m: int) -> bool:
    """Whether every stage fits under the memory the solvers charge: the schedule's closed
    forms for the layout's own warm-up (tests/test_schedule_truth.py checks that they bound
    the simulated memory, so such a plan fits in simulation too)."""
    memory = plan.cluster.memory
    replicas = [s.replicas for s in plan.stages]
    warmups = [(sum(replicas[s:]) - 1) // r for s, r in enumerate(replicas)]
    into = [  # bytes a microbatch sends across the boundary before stage b
        sum(size for later in plan.stages[b:] for src, size in later.recv_bytes if src < b)
        for b in range(len(plan.stages) + 1)
    ]
    for s, stage in enumerate(plan.stages):
        counts = rules.memory_counts(len(replicas) - s, warmups[s], m, max(warmups))
        need = max(counts.charges(  # a pending W at all its activations, as the solvers
            stage.weight_bytes, stage.grad_bytes, stage.param_bytes, stage.activation_bytes,
            stage.activation_bytes,
        )) + stage_bytes(into[s], into[s + 1])  # and its message buffers  # fmt: skip
        if memory is not None and need > memory:
            return False
    return True


def solve(g: CostGraph, cluster: Cluster, solver: str, schedule: str, m: int, **options) -> Plan:
    plan = pdcompile.plan(g, cluster, solver=solver, schedule=schedule, num_microbatches=m,
                          recompute=False, **options)  # fmt: skip
    assert plan.predicted_time == pytest.approx(evaluate(plan, g).predicted_time, rel=1e-12)
    assert plan.fits_memory
    return plan


costs = st.lists(
    st.tuples(st.floats(0.01, 10), st.integers(0, 200), st.integers(0, 60)), min_size=12,
    max_size=12,
)  # fmt: skip
edges = st.lists(st.booleans(), min_size=66, max_size=66)  # every pair of 12 nodes


@st.composite
def clusters(draw, max_devices: int = 4, memory: bool = False) -> Cluster:
    d = draw(st.integers(1, max_devices))
    speed = draw(st.none() | st.lists(st.sampled_from([0.25, 1.0, 2.0]), min_size=d, max_size=d))
    limit = draw(st.sampled_from([None, 400, 700, 1200])) if memory else None
    return Cluster([(d, draw(st.sampled_from([20.0, 200.0])))], memory=limit, speed=speed)


# -- ideal ---------------------------------------------------------------------------------


@settings(deadline=None, max_examples=300)
@given(n=st.integers(1, 7), edges=edges, costs=costs, source=st.booleans(), cluster=clusters(),
       schedule=st.sampled_from(SCHEDULES), m=st.integers(1, 6))  # fmt: skip
def test_ideal_equals_brute_force_on_small_dags(n, edges, costs, source, cluster, schedule, m):
    m = streamable(schedule, m, cluster)
    g = dag(n, edges, costs, source)
    plan = solve(g, cluster, "ideal", schedule, m)
    assert "fallback" not in plan.options
    assert plan.predicted_time == pytest.approx(brute_force(g, cluster, schedule, m), rel=1e-9)
    first = set(plan.stages[0].nodes)
    assert all(n in first for n in g.nodes if g.graph.nodes[n]["kind"] == "input")


@settings(deadline=None, max_examples=150)
@given(n=st.integers(1, 12), costs=costs, cluster=clusters(6, memory=True),
       schedule=st.sampled_from(SCHEDULES), m=st.integers(1, 8))  # fmt: skip
def test_ideal_equals_dp_on_chains(n, costs, cluster, schedule, m) -> None:
    m = streamable(schedule, m, cluster)
    times, params, acts = zip(*costs[:n], strict=True)
    g = chain(times, params, acts, [10 * i for i in range(n)])
    try:
        expected = solve(g, cluster, "dp", schedule, m).predicted_time
    except PartitionError:
        with pytest.raises(PartitionError, match="no placement fits"):
            solve(g, cluster, "ideal", schedule, m)
        return
    plan = solve(g, cluster, "ideal", schedule, m)
    assert plan.options["ideals"] == n + 1
    assert plan.predicted_time == pytest.approx(expected, rel=1e-9)


@settings(deadline=None, max_examples=200)
@given(n=st.integers(1, 10), edges=edges, costs=costs, source=st.booleans(),
       cluster=clusters(5, memory=True), schedule=st.sampled_from(SCHEDULES),
       m=st.integers(1, 6))  # fmt: skip
def test_ideal_is_never_worse_than_dp_on_small_dags(n, edges, costs, source, cluster, schedule, m):
    m = streamable(schedule, m, cluster)
    g = dag(n, edges, costs, source)
    try:
        baseline = solve(g, cluster, "dp", schedule, m).predicted_time
    except PartitionError:
        baseline = math.inf
    try:
        plan = solve(g, cluster, "ideal", schedule, m)
    except PartitionError:
        assert baseline == math.inf
        return
    assert plan.predicted_time <= baseline * (1 + 1e-12)


def test_ideal_beats_every_linear_order_dp_tries() -> None:
    # three independent layers of 9, 8 and 1 s with 1000 B of parameters each: the best plan
    # puts the first and the last on two replicas and the middle one alone, a stage that is no
    # run of the orders dp cuts (all three are n0 n1 n2 here)
    g = dag(3, [False] * 3, [(9, 1000, 0), (8, 1000, 0), (1, 1000, 0)], False)
    cluster = Cluster.parse("3@100B/s")
    ideal = solve(g, cluster, "ideal", "1f1b", 6)
    assert [(s.nodes, s.replicas) for s in ideal.stages] == [(("n0", "n2"), 2), (("n1",), 1)]
    assert ideal.predicted_time == pytest.approx(brute_force(g, cluster, "1f1b", 6), rel=1e-9)
    assert ideal.predicted_time < 0.95 * solve(g, cluster, "dp", "1f1b", 6).predicted_time


def test_ideal_falls_back_to_dp_and_says_why() -> None:
    g = dag(8, [False] * 66, [(1.0, 10, 1)] * 12, False)  # an antichain: 2^8 ideals
    cluster = Cluster.parse("3@100B/s")
    dp_time = solve(g, cluster, "dp", "1f1b", 4).predicted_time
    plan = solve(g, cluster, "ideal", "1f1b", 4, max_ideals=100)
    assert plan.solver == "ideal" and plan.options["fallback"] == "dynprog"
    assert "more ideals than max_ideals=100" in plan.options["reason"]
    assert plan.predicted_time == dp_time
    assert "fallback" not in solve(g, cluster, "ideal", "1f1b", 4, max_ideals=256).options
    small = solve(g, cluster, "ideal", "1f1b", 4, max_transitions=1000)
    assert "max_transitions=1e+03" in small.options["reason"]
    hierarchical = solve(g, Cluster.parse("2@10B/s,2@1B/s"), "ideal", "1f1b", 4)
    assert "2 levels" in hierarchical.options["reason"]
    with pytest.raises(PartitionError, match="ideal: unknown options \\['orders'\\]"):
        solve(g, cluster, "ideal", "1f1b", 4, orders=["dfs"])


# -- cpsat ---------------------------------------------------------------------------------


@settings(deadline=None, max_examples=250)
@given(n=st.integers(1, 6), costs=costs, cluster=clusters(4, memory=True),
       schedule=st.sampled_from(SCHEDULES), m=st.integers(1, 6))  # fmt: skip
def test_cpsat_equals_brute_force_on_small_chains(n, costs, cluster, schedule, m) -> None:
    m = streamable(schedule, m, cluster)
    times, params, acts = zip(*costs[:n], strict=True)
    g = chain(times, params, acts, [10 * i for i in range(n)])
    best = brute_force(g, cluster, schedule, m)  # exact memory, every speed
    if best == math.inf:
        with pytest.raises(PartitionError, match="no placement fits"):
            solve(g, cluster, "cpsat", schedule, m)
        return
    plan = solve(g, cluster, "cpsat", schedule, m)
    options = plan.options
    assert options["status"] == "OPTIMAL"
    # the documented rounding: the bound holds, and the plan is within 4 ticks of it
    assert options["bound"] <= best * (1 + 1e-12)
    assert best <= plan.predicted_time <= options["bound"] + 4 * options["tick_s"]
    assert options["gap"] == pytest.approx(1 - options["bound"] / plan.predicted_time)


def test_cpsat_and_dp_meet_a_memory_limit_exactly() -> None:
    # two layers of 200 B of weights and 50 B of activations, 4 devices, 300 B each: two stages
    # of two replicas fit the counts exactly (2 and 1 microbatches in flight; simulated, stage
    # 0's 2 come before its first backward, when its 100 B of gradients are not held yet, and
    # each replica of it runs 2 of the 4 microbatches, which the counts do not see). dp's bound,
    # the warm-up the devices after a stage allow ((4 - 1) // 2 = 1), finds them too (the old
    # bound, stages after it, counted 3 and settled for a plan twice as slow)
    g = chain([1.0, 1.0], [100, 100], [50, 50], [0, 0])
    cluster = Cluster.parse("4@1GB/s", memory=300)
    for solver in ("dp", "cpsat"):
        plan = solve(g, cluster, solver, "1f1b", 4)
        assert [(len(s.nodes), s.replicas) for s in plan.stages] == [(1, 2), (1, 2)], solver
        assert [s.memory_bytes for s in plan.stages] == [250, 250]
        assert plan.predicted_time == pytest.approx(brute_force(g, cluster, "1f1b", 4), rel=5e-6)


@pytest.mark.parametrize("solver", ["cpsat", "ideal", "dp"])
@pytest.mark.parametrize("speed", [(1.0, 0.25), (0.25, 1.0)])
def test_a_slow_device_gets_less_work(solver, speed) -> None:
    g = chain([1.0] * 8, [0] * 8, [0] * 8, [0] * 8)
    plan = solve(g, Cluster([(2, 1e9)], speed=speed), solver, "1f1b", 4)
    slow = next(s for s in plan.stages if speed[s.ranks[0]] == 0.25)
    assert len(slow.nodes) == 1 and plan.predicted_time == pytest.approx(7.0)


def test_cpsat_is_deterministic_and_reports_its_bound() -> None:
    g = dag(10, [i % 3 == 0 for i in range(66)], [(1 + i % 4, 10 * i, i) for i in range(12)],
            True)  # fmt: skip
    cluster = Cluster([(4, 50.0)], memory=2000, speed=(1.0, 1.0, 0.5, 2.0))
    first, second = (solve(g, cluster, "cpsat", "pipedream", 4) for _ in range(2))
    assert first.stages == second.stages and first.options == second.options
    assert first.options["status"] == "OPTIMAL"
    assert first.options["bound"] <= first.predicted_time
    assert first.predicted_time <= solve(g, cluster, "dp", "pipedream", 4).predicted_time
    again = solve(g, cluster, "ideal", "pipedream", 4)
    assert again.stages == solve(g, cluster, "ideal", "pipedream", 4).stages


def test_cpsat_falls_back_or_refuses_and_says_why() -> None:
    g = chain([1.0] * 6, [10] * 6, [1] * 6, [4] * 6)
    plan = solve(g, Cluster.parse("4"), "cpsat", "1f1b", 4, max_cells=10)
    assert plan.options["fallback"] == "dynprog" and "max_cells=10" in plan.options["reason"]
    plan = solve(g, Cluster.parse("2@1GB/s,2@1MB/s"), "cpsat", "1f1b", 4)
    assert "2 levels" in plan.options["reason"]
    with pytest.raises(PartitionError, match="cpsat: unknown options"):
        solve(g, Cluster.parse("4"), "cpsat", "1f1b", 4, time_limit=1)
    with pytest.raises(PartitionError, match="no placement fits.*proven by cpsat"):
        solve(g, Cluster.parse("4", memory=20), "cpsat", "1f1b", 4)


@pytest.mark.parametrize("solver", ["ideal", "cpsat"])
def test_pipedream_with_a_tied_tensor_falls_back_to_dp(solver) -> None:
    """Neither model says that a stage holding part of a tie keeps one replica: dp does."""
    g = chain([10.0, 1.0, 1.0, 1.0], [0, 1000, 1000, 0], [1] * 4, [10] * 4)
    g.meta["ties"] = [{"nodes": ["n0", "n3"], "grad_bytes": 64}]
    cluster = Cluster.parse("4@100B/s")
    plan = solve(g, cluster, solver, "pipedream", 3)
    assert plan.options["fallback"] == "dynprog" and "tied tensor" in plan.options["reason"]
    assert plan.predicted_time == solve(g, cluster, "dp", "pipedream", 3).predicted_time
    assert "fallback" not in solve(g, cluster, solver, "1f1b", 3).options


@pytest.mark.parametrize("model", ["vgg16", "resnet50", "gnmt"])
def test_never_worse_than_dp_on_published_profiles(model) -> None:
    g = CostGraph.from_pipedream(DATA / model / "graph.txt", batch_size=128)
    free = solve(g, Cluster.parse("4@1.25GB/s"), "dp", "1f1b", 8)
    tight = 0.7 * max(s.memory_bytes for s in free.stages)  # dp's safe bound starts to bind
    for cluster in (Cluster.parse("4@1.25GB/s"), Cluster.parse("4@1.25GB/s", memory=tight)):
        for schedule in ("pipedream", "1f1b"):
            try:
                dp = solve(g, cluster, "dp", schedule, 8).predicted_time
            except PartitionError:
                dp = math.inf
            for solver in ("ideal", "cpsat"):
                try:
                    plan = solve(g, cluster, solver, schedule, 8)
                except PartitionError:
                    assert dp == math.inf
                    continue
                assert plan.predicted_time <= dp * (1 + 1e-12), (solver, schedule)


def test_both_are_registered() -> None:
    names = pdcompile.solvers()
    assert names["ideal"].startswith("Exact DP over the DAG's ideals")
    assert names["cpsat"].startswith("CP-SAT")


@pytest.mark.parametrize("memory", [258, 188])
def test_cpsat_encodes_memory_counts_of_both_the_stages_and_the_warmup(memory) -> None:
    """A schedule whose counts depend on both S - s and w = (devices from s on - 1) // r_s
    (CP-SAT pairs the two one-hots): its optimum is brute force's under the same counts (and
    the message buffers: 8 of 1-byte messages, 8 B, per stage)."""
    from ortools.sat.python import cp_model

    from pdcompile.passes.planning.cost_model import Pricing, get_cost_model
    from pdcompile.passes.planning.solvers.cpsat import _Model
    from pdcompile.passes.planning.solvers.dp import Prefix
    from pdcompile.scheduling.base import MemoryCounts
    from pdcompile.scheduling.one_f_one_b import OneForwardOneBackward

    class Both(OneForwardOneBackward):
        def memory_counts(self, stages_from_here, warmup, num_microbatches, deepest):
            return MemoryCounts(min(stages_from_here, num_microbatches) + warmup, 0, warmup % 2)

    rules, prices, m = Both(), get_cost_model(), 4
    times, params, acts, outs = [3.0, 1.0, 2.0, 1.0], [40, 10, 30, 20], [20, 30, 10, 40], [1] * 4
    g = chain(times, params, acts, outs)

    def score(cuts: tuple[int, ...], replicas: tuple[int, ...]) -> float:
        bounds, worst = [0, *cuts, len(times)], 0.0
        for s, r in enumerate(replicas):
            j, k = bounds[s], bounds[s + 1]
            w = (sum(replicas[s:]) - 1) // r
            inflight, _, versions = rules.memory_counts(len(replicas) - s, w, m, w)[:3]
            messages = stage_bytes(outs[j - 1] if j else 0, outs[k - 1] if k < len(times) else 0)
            if (2 + versions) * sum(params[j:k]) + inflight * sum(acts[j:k]) + messages > memory:
                return math.inf
            comm = prices.transfer_s(outs[j - 1], 100.0, r) if j else 0.0
            every = prices.updates_every(rules, r, m)
            allreduce = prices.allreduce_s(sum(params[j:k]), r, 100.0, every)
            worst = max(worst, prices.stage_time(sum(times[j:k]), r, comm, allreduce))
        return worst

    best = min(
        score(cuts, replicas)
        for count in range(1, 5)
        for cuts in itertools.combinations(range(1, 4), count - 1)
        for replicas in itertools.product(range(1, 5), repeat=count)
        if sum(replicas) <= 4
    )
    cluster = Cluster.parse("4@100B/s", memory=memory)
    cp = _Model(Prefix(g, g.nodes), len(g.nodes), Pricing(cluster, rules, prices, m), best)
    assert cp.by_stages and cp.by_warmup
    solver = cp_model.CpSolver()
    assert solver.solve(cp.model) == cp_model.OPTIMAL
    stages = cp.solution(solver)
    found = score(tuple(j for j, _, _ in stages[1:]), tuple(r for _, _, r in stages))
    assert best <= found <= best + 4 / cp.scale
