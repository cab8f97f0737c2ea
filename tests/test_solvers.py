"""Clusters, plans, the cost model, the registry, `dp` against brute force, and the baselines."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile import Cluster, CostGraph, PartitionError, Plan, Stage, evaluate
from pdcompile.passes.planning.cost_model import CostModel, register_cost_model
from pdcompile.passes.planning.evaluation import price
from pdcompile.passes.planning.plans import consecutive_ranks
from pdcompile.scheduling import get_schedule

# random clusters and counts give replica counts that do not divide the microbatches: the
# warning is not the point here (tests/test_replica_balance.py asserts it)
pytestmark = pytest.mark.filterwarnings("ignore::pdcompile.core.errors.PlanWarning")

DATA = Path(__file__).parent / "data" / "pipedream"


def chain(times, params, acts, outs, batch=8) -> CostGraph:
    g = CostGraph(batch_size=batch)
    for i, (t, p, a, o) in enumerate(zip(times, params, acts, outs, strict=True)):
        g.add_node(f"n{i}", forward_s=t / 3, backward_s=2 * t / 3, param_bytes=p, grad_bytes=p,
                   activation_bytes=a, output_bytes=o)  # fmt: skip
        if i:
            g.add_edge(f"n{i - 1}", f"n{i}", outs[i - 1])
    return g


def skeleton(cost_graph: CostGraph, cluster: Cluster, cuts, replicas, schedule, m) -> Plan:
    nodes = cost_graph.nodes
    ranks = consecutive_ranks(replicas)
    bounds = [0, *cuts, len(nodes)]
    stages = tuple(
        Stage(index=i, nodes=tuple(nodes[bounds[i] : bounds[i + 1]]), replicas=r, ranks=ranks[i])
        for i, r in enumerate(replicas)
    )
    return Plan(stages=stages, cluster=cluster, schedule=schedule, num_microbatches=m)


def brute_force(cost_graph: CostGraph, cluster: Cluster, schedule: str, m: int) -> float:
    """The best predicted time over every contiguous partition and replica assignment the
    schedule runs with m microbatches (under `pipedream`, none replicating a stage that holds a
    tied tensor's copy)."""
    n, total = len(cost_graph.nodes), cluster.num_devices
    rules = get_schedule(schedule)
    best = math.inf
    for count in range(1, min(n, total) + 1):
        for cuts in itertools.combinations(range(1, n), count - 1):
            for replicas in itertools.product(range(1, total + 1), repeat=count):
                if sum(replicas) <= total and rules.accepts(replicas, m):
                    plan = price(skeleton(cost_graph, cluster, cuts, replicas, schedule, m),
                                 cost_graph)  # fmt: skip
                    tied = {s for stages, _ in plan.ties for s in stages}
                    if schedule != "pipedream" or all(replicas[s] == 1 for s in tied):
                        best = min(best, plan.predicted_time)
    return best


# -- clusters and plans --------------------------------------------------------------------


def test_cluster_parse_levels_bandwidths_and_round_trip() -> None:
    c = Cluster.parse("8@300GB/s,16@25Gbit/s", memory="80GB")
    assert c.num_devices == 128 and c.memory == 80e9
    assert c.bandwidth(0, 7) == 300e9 and c.bandwidth(7, 8) == 25e9 / 8
    assert c.level_of(8, 15) == 0 and c.level_of(0, 127) == 1
    assert Cluster.parse(str(c), memory="80GB") == c
    assert Cluster.parse("4").levels[0].bandwidth == pdcompile.core.cluster.DEFAULT_BANDWIDTH
    assert Cluster.from_json(c.to_json()) == c


@pytest.mark.parametrize(
    ("text", "memory", "words"),
    [
        ("0@1GB/s", None, "use an integer >= 1"),
        ("4@0GB/s", None, "positive number of bytes/s"),
        ("four", None, "COUNT@BANDWIDTH"),
        ("4@10parsecs/s", None, "cannot read bandwidth"),
        ("4", "-1GB", "cannot read memory"),
        ("4", 0, "positive number of bytes"),
    ],
)
def test_bad_clusters_are_partition_errors(text, memory, words) -> None:
    with pytest.raises(PartitionError, match=words):
        Cluster.parse(text, memory=memory)


def test_plan_json_round_trip_and_corrupt_file(tmp_path) -> None:
    g = chain([1.0, 2.0, 3.0], [10, 20, 30], [1, 1, 1], [4, 4, 4])
    plan = pdcompile.plan(g, Cluster.parse("4@1GB/s"), schedule="1f1b", num_microbatches=4)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert "predicted" in str(plan) and "stage" in str(plan)
    path.write_text(plan.to_json()[:50])
    with pytest.raises(PartitionError, match=r"plan.json:\d+:\d+: not valid JSON"):
        Plan.load(path)


def test_evaluate_refuses_plans_for_another_model_or_world_size() -> None:
    g = chain([1.0, 2.0], [1, 1], [1, 1], [4, 4])
    other = chain([1.0, 2.0, 3.0], [1, 1, 1], [1, 1, 1], [4, 4, 4])
    plan = pdcompile.plan(other, Cluster.parse("3"), solver="uniform")
    with pytest.raises(PartitionError, match="does not match this graph.*another model"):
        evaluate(plan, g)
    with pytest.raises(PartitionError, match="another world size"):
        evaluate(plan, other, cluster=Cluster.parse("2"))


def test_cost_model_formulas_on_a_worked_example() -> None:
    # two stages: n0 (t=3, 100 B of params) on 2 replicas, n1 (t=1) on 1; 10 B cross the cut
    g = chain([3.0, 1.0], [100, 0], [7, 5], [10, 2])
    cluster = Cluster.parse("4@100B/s")
    plan = evaluate(skeleton(g, cluster, [1], [2, 1], "pipedream", 4), g)
    first, second = plan.stages
    ring = 2 * (2 - 1) / 2 * 100 / 100  # ring all-reduce of 100 B among 2 at 100 B/s
    assert first.allreduce_s == pytest.approx(ring / 2)  # pipedream: one update per 2 minibatches
    assert first.time_s == pytest.approx(3.0 / 2 + ring / 2)
    assert second.comm_s == pytest.approx(2 * 10 / 100)  # activations forward, gradients back
    assert plan.predicted_time == pytest.approx(max(first.time_s, 1.0 + 0.2))
    assert plan.lower_bound == pytest.approx(4.0 / 4)
    # pipedream: w_0 = (2 + 1 - 1) // 2 = 1 warm-up, so 2 in flight, each on its stashed
    # version; the 100 B of gradients are held from a backward to its update, when 1 is
    assert first.memory_bytes == max(100 + 2 * 100 + 2 * 7, (100 + 100) + 2 * 100 + 7)
    sync = evaluate(plan, g, schedule="1f1b")
    assert sync.stages[0].allreduce_s == pytest.approx(ring / 4)  # once per 4 microbatches
    assert sync.step_time == pdcompile.simulate(sync).time_per_step  # one set of numbers
    # stage 0's share, then its all-reduce, which starts halfway through its last backward
    # (buckets reduced as gradients get ready: runtime/grad_buckets.py)
    assert sync.step_time >= (4 // 2) * 3.0 + 1.0 + ring - first.backward_s / 2


# -- the registry --------------------------------------------------------------------------


def test_register_a_solver_and_plan_with_it() -> None:
    @pdcompile.register_solver("single")
    def single(cost_graph, cluster, options):
        """Everything on device 0."""
        kit = pdcompile.passes.planning.solver_kit
        return kit.make_plan(cost_graph, cluster, [(cost_graph.nodes, 1)], options, "single")

    assert pdcompile.solvers()["single"] == "Everything on device 0."
    g = chain([1.0, 2.0], [1, 1], [1, 1], [4, 4])
    plan = pdcompile.plan(g, Cluster.parse("2"), solver="single")
    assert plan.num_stages == 1 and plan.solver == "single" and plan.solve_time_s >= 0
    assert {"dynprog", "uniform", "params", "blocks"} <= set(pdcompile.solvers())
    with pytest.raises(PartitionError, match="unknown solver 'nope'; registered: .*dynprog"):
        pdcompile.plan(g, Cluster.parse("2"), solver="nope")
    with pytest.raises(PartitionError, match="unknown schedule .zb.; registered: 1f1b"):
        pdcompile.plan(g, Cluster.parse("2"), schedule="zb")


# -- dp is exact ---------------------------------------------------------------------------

clusters = st.sampled_from(["1", "3", "5", "6", "2@8B/s,3@1B/s", "3@20B/s,2@2B/s", "4@50B/s"])


@settings(deadline=None, max_examples=40)
@given(
    data=st.data(),
    n=st.integers(1, 12),
    cluster_text=clusters,
    schedule=st.sampled_from(["1f1b", "gpipe", "pipedream", "2bw"]),
    m=st.integers(1, 8),
)
def test_dp_equals_brute_force_on_chains(data, n, cluster_text, schedule, m) -> None:
    times = data.draw(st.lists(st.floats(0.01, 10), min_size=n, max_size=n))
    params = data.draw(st.lists(st.integers(0, 200), min_size=n, max_size=n))
    outs = data.draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    g = chain(times, params, [1] * n, outs)
    cluster = Cluster.parse(cluster_text)
    if schedule == "2bw":  # at least as many microbatches as any plan has stages
        m = max(m, cluster.num_devices)
    if n > 8 and cluster.num_devices > 5:
        n_check = None  # brute force too slow; still run dp
    else:
        n_check = brute_force(g, cluster, schedule, m)
    plan = pdcompile.plan(g, cluster, schedule=schedule, num_microbatches=m)
    assert plan.predicted_time == pytest.approx(evaluate(plan, g).predicted_time, rel=1e-12)
    if n_check is not None:
        assert plan.predicted_time == pytest.approx(n_check, rel=1e-9, abs=1e-12)


@settings(deadline=None, max_examples=40)
@given(
    data=st.data(),
    n=st.integers(2, 7),
    cluster_text=st.sampled_from(["3@100B/s", "4@100B/s", "5@50B/s", "2@800B/s,2@100B/s"]),
    schedule=st.sampled_from(["pipedream", "1f1b"]),
)
def test_dp_equals_brute_force_with_a_tied_tensor(data, n, cluster_text, schedule) -> None:
    """Nodes a < b share a tensor (a tied embedding): under pipedream no stage holding one of
    its copies is replicated, and dp stays exact among such plans. Slow links make replicating
    a stage costly, so that the best plans mix replicated and single stages."""
    times = data.draw(st.lists(st.floats(0.01, 10), min_size=n, max_size=n))
    params = data.draw(st.lists(st.integers(0, 2000), min_size=n, max_size=n))
    a, b = sorted(data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True)))
    g = chain(times, params, [1] * n, [10] * n)
    g.meta["ties"] = [{"nodes": [f"n{a}", f"n{b}"], "grad_bytes": 64}]
    cluster = Cluster.parse(cluster_text)
    plan = pdcompile.plan(g, cluster, schedule=schedule, num_microbatches=4)
    if schedule == "pipedream":
        assert all(plan.stages[s].replicas == 1 for stages, _ in plan.ties for s in stages)
    assert plan.predicted_time == pytest.approx(brute_force(g, cluster, schedule, 4), rel=1e-9)


def test_dp_gives_up_a_faster_plan_that_would_replicate_a_tie_stage() -> None:
    # n0: much compute, no parameters (best replicated); n1, n2: heavy all-reduces; n0 and n3
    # share a tensor. Unconstrained, n0 alone on 3 replicas is best; pipedream may not do it.
    g = chain([10.0, 1.0, 1.0, 1.0], [0, 1000, 1000, 0], [1] * 4, [10] * 4)
    cluster = Cluster.parse("4@100B/s")
    free = pdcompile.plan(g, cluster, schedule="pipedream", num_microbatches=3)
    g.meta["ties"] = [{"nodes": ["n0", "n3"], "grad_bytes": 64}]
    tied = pdcompile.plan(g, cluster, schedule="pipedream", num_microbatches=3)
    assert free.stages[0].nodes == ("n0",) and free.stages[0].replicas == 3
    assert all(s.replicas == 1 for s in tied.stages if {"n0", "n3"} & set(s.nodes))
    assert tied.predicted_time > free.predicted_time
    assert tied.predicted_time == pytest.approx(brute_force(g, cluster, "pipedream", 3))


def test_streaming_plans_default_to_whole_rounds_of_replicas() -> None:
    """Twice the devices (8) is not a multiple of 3 replicas: the default rounds up to 9, as
    pipedream's and 2bw's schedules need (and as 1f1b, which accepts 8, gets too, so no replica
    idles: tests/test_replica_balance.py); an explicit count is kept."""
    from pdcompile.scheduling import build_schedule

    g = chain([10.0, 1.0, 1.0, 1.0], [0, 1000, 1000, 0], [1] * 4, [10] * 4)
    cluster = Cluster.parse("4@100B/s")
    for schedule in ("pipedream", "2bw"):
        plan = pdcompile.plan(g, cluster, schedule=schedule)
        assert [s.replicas for s in plan.stages] == [3, 1] and plan.num_microbatches == 9
        assert plan.step_time == pytest.approx(evaluate(plan, g).step_time)
        ranks = [s.ranks for s in plan.stages]
        build_schedule(schedule, ranks, {(0, 1): True}, plan.num_microbatches)
    explicit = pdcompile.plan(g, cluster, schedule="pipedream", num_microbatches=8)
    assert explicit.num_microbatches == 8
    assert pdcompile.plan(g, cluster, schedule="1f1b").num_microbatches == 9


def test_split_ties_marks_the_stages_holding_part_of_a_tie() -> None:
    from pdcompile.passes.planning.solvers.dp import split_ties

    for spots in ([1, 4], [0, 2, 5], [3, 6], [0, 6]):
        split = split_ties(7, [spots])
        for j in range(7):
            for k in range(j + 1, 8):
                held = sum(j <= p < k for p in spots)
                assert split[j, k] == (0 < held < len(spots)), (spots, j, k)


def test_plan_refuses_a_solvers_replicated_tie_stage_under_pipedream() -> None:
    @pdcompile.register_solver("replicate_all")
    def replicate_all(cost_graph, cluster, options):
        """Two stages, the first replicated."""
        nodes = cost_graph.nodes
        groups = [(nodes[:1], cluster.num_devices - 1), (nodes[1:], 1)]
        return pdcompile.passes.planning.solver_kit.make_plan(
            cost_graph, cluster, groups, options, "replicate_all"
        )

    g = chain([1.0, 1.0, 1.0], [8, 8, 8], [1, 1, 1], [4, 4, 4])
    g.meta["ties"] = [{"nodes": ["n0", "n2"], "grad_bytes": 32}]
    with pytest.raises(PartitionError, match="stage 0 2 replicas.*under pipedream"):
        pdcompile.plan(g, Cluster.parse("3"), solver="replicate_all", schedule="pipedream")
    plan = pdcompile.plan(g, Cluster.parse("3"), solver="replicate_all", schedule="2bw")
    assert plan.stages[0].replicas == 2


@pytest.mark.parametrize("model", ["vgg16", "resnet50", "gnmt"])
@pytest.mark.parametrize("cluster_text", ["16@1.25GB/s", "4@10GB/s,4@1.25GB/s"])
def test_dp_beats_every_baseline_on_published_profiles(model, cluster_text) -> None:
    g = CostGraph.from_pipedream(DATA / model / "graph.txt", batch_size=128)
    cluster = Cluster.parse(cluster_text)
    for schedule in ("pipedream", "1f1b"):
        best = pdcompile.plan(g, cluster, schedule=schedule)
        for baseline in ("uniform", "params", "blocks"):
            other = pdcompile.plan(g, cluster, solver=baseline, schedule=schedule)
            assert best.predicted_time <= other.predicted_time * (1 + 1e-12), baseline
        assert best.predicted_time >= best.lower_bound


def test_flat_and_general_dp_agree() -> None:
    g = CostGraph.from_pipedream(DATA / "resnet50" / "graph.txt", batch_size=128)
    flat = pdcompile.plan(g, Cluster.parse("16@1.25GB/s"), schedule="pipedream")
    general = pdcompile.plan(g, Cluster.parse("16@1.25GB/s", memory="1000TB"), schedule="pipedream")
    assert flat.predicted_time == pytest.approx(general.predicted_time, rel=1e-9)


@settings(deadline=None, max_examples=25)
@given(
    data=st.data(),
    n=st.integers(2, 16),
    cluster_text=st.sampled_from(
        ["4@40B/s,3@4B/s", "2@9B/s,2@3B/s,3@1B/s", "3@5B/s,3@50B/s", "8@100B/s,2@2B/s", "2,2,2,2"]
    ),
    schedule=st.sampled_from(["1f1b", "gpipe", "pipedream", "2bw"]),
    m=st.integers(1, 8),
)
def test_bisection_equals_the_general_dp_on_hierarchies(data, n, cluster_text, schedule, m) -> None:
    """The fast path (bisection over residues of the first rank) against the exact general DP
    (itself checked against brute force above), on clusters too large for brute force."""
    times = data.draw(st.lists(st.floats(0.01, 10), min_size=n, max_size=n))
    params = data.draw(st.lists(st.integers(0, 400), min_size=n, max_size=n))
    outs = data.draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    g = chain(times, params, [1] * n, outs)
    searched = 2 * Cluster.parse(cluster_text).num_devices
    if get_schedule(schedule).streaming:  # the default count: every replica count is allowed
        m = None
    fast = pdcompile.plan(g, Cluster.parse(cluster_text), schedule=schedule, num_microbatches=m)
    # a memory limit no plan reaches sends dp down its general DP
    roomy = Cluster.parse(cluster_text, memory=1e30)
    general = pdcompile.plan(g, roomy, schedule=schedule, num_microbatches=m, recompute=False)
    # compared at the count both searched with (the plans may then run different counts)
    at = m or searched
    fast, general = (price(p.with_(num_microbatches=at), g) for p in (fast, general))
    assert fast.predicted_time == pytest.approx(general.predicted_time, rel=1e-9, abs=1e-12)


def test_memory_limit_no_plan_fits_names_the_numbers() -> None:
    g = chain([1.0, 1.0], [10**9, 10**9], [1, 1], [4, 4])
    with pytest.raises(PartitionError, match="no placement fits: device memory is 1e\\+08 B"):
        pdcompile.plan(g, Cluster.parse("2", memory="100MB"), recompute=False)


def test_memory_limit_is_respected() -> None:
    # 6 nodes of 100 B of parameters (+100 B of gradients) and 50 B of activations, 3 devices:
    # the best plan [2, 2, 2] keeps 3 microbatches in flight at stage 0: 400 + 3 * 100 = 700 B,
    # and the buffers of its 4-byte messages, 8 * 4 B (pdcompile/core/message_buffers.py).
    g = chain([1.0] * 6, [100] * 6, [50] * 6, [4] * 6)
    free = pdcompile.plan(g, Cluster.parse("3"), schedule="1f1b", num_microbatches=4)
    assert max(s.memory_bytes for s in free.stages) == 700
    assert max(free.rank_memory) == 732
    fits = pdcompile.plan(g, Cluster.parse("3", memory=732), schedule="1f1b", num_microbatches=4,
                          recompute=False)  # fmt: skip
    assert fits.fits_memory and all(b <= 732 for b in fits.rank_memory)
    with pytest.raises(PartitionError, match="no placement fits: device memory is 731 B"):
        pdcompile.plan(g, Cluster.parse("3", memory=731), schedule="1f1b", num_microbatches=4,
                       recompute=False)  # fmt: skip


def test_a_plan_with_more_stages_than_nodes_is_refused() -> None:
    g = chain([1.0, 2.0], [1, 1], [1, 1], [4, 4])
    plan = skeleton(g, Cluster.parse("3"), [1], [1, 1], "1f1b", 2)
    empty = Stage(index=2, nodes=(), replicas=1, ranks=(2,))
    with pytest.raises(PartitionError, match=r"more stages \(3\) than it can fill from 2 nodes"):
        evaluate(plan.with_(stages=(*plan.stages, empty)), g)


@st.composite
def random_dags(draw: st.DrawFn) -> CostGraph:
    n = draw(st.integers(2, 10))
    g = CostGraph(batch_size=4)
    for i in range(n):
        t = draw(st.floats(0.01, 5))
        p = draw(st.integers(0, 500))
        g.add_node(f"n{i}", forward_s=t / 3, backward_s=2 * t / 3, param_bytes=p, grad_bytes=p,
                   activation_bytes=draw(st.integers(0, 50)),
                   output_bytes=draw(st.integers(0, 200)))  # fmt: skip
        preds = draw(st.sets(st.integers(0, i - 1), max_size=2)) if i else set()
        for j in sorted(preds | ({i - 1} if i else set())):
            g.add_edge(f"n{j}", f"n{i}", g.graph.nodes[f"n{j}"]["output_bytes"])
    return g


@settings(deadline=None, max_examples=60)
@given(g=random_dags(), cluster_text=clusters, schedule=st.sampled_from(["1f1b", "pipedream"]))
def test_dp_is_never_worse_than_a_baseline(g, cluster_text, schedule) -> None:
    cluster = Cluster.parse(cluster_text)
    best = pdcompile.plan(g, cluster, schedule=schedule, num_microbatches=4)
    for baseline in ("uniform", "params", "blocks"):
        other = pdcompile.plan(g, cluster, solver=baseline, schedule=schedule, num_microbatches=4)
        assert best.predicted_time <= evaluate(other, g).predicted_time * (1 + 1e-9), baseline


# -- solvers ask the cost model and the schedule ------------------------------------------


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "pipedream", "2bw", "zb-h1", "zb-h2"])
def test_memory_bounds_are_the_closed_forms_the_solvers_charge(schedule) -> None:
    """A stage with r replicas and `after` of the pipeline's D devices from its first rank on
    has a warm-up of at most w = (after - 1) // r, and the pipeline one of at most D - 1 (after
    - r - 1 with no stage before): (in flight, deferred W, versions) are the closed forms of
    those (tests/test_split_memory_budget.py checks them against simulation)."""
    rules = get_schedule(schedule)
    for d, after, r, m in itertools.product(range(1, 9), range(1, 9), range(1, 9), (1, 3, 8)):
        if r > after or after > d:
            continue
        w = (after - 1) // r
        deepest = max(w, after - r - 1 if after == d else d - 1)
        two = min(w, m)  # 2bw's warm-up is capped at the step
        h1, h2 = min(w + 1, m), min(2 * w + 1, m)  # I pending (zb-h2: twice 1F1B's warm-up)
        expected = {
            "1f1b": (h1, 0, 0), "gpipe": (m, 0, 0), "pipedream": (w + 1, 0, w + 1),
            "2bw": (two + 1, 0, 2 if two else 1), "zb-h1": (h1, min(deepest + 1, m) - h1, 0),
            "zb-h2": (h2, min(2 * deepest + 1, m) - h2, 0),
        }[schedule]  # fmt: skip
        assert rules.memory_bounds(after, r, m, d)[:3] == expected, (d, after, r, m)


@register_cost_model("test-free-links")
class FreeLinks(CostModel):
    """Transfers between stages cost nothing."""

    def transfer_s(self, cut_bytes, bandwidth, replicas):
        return 0.0 * cut_bytes


@pytest.mark.parametrize("solver", ["dp", "ideal", "cpsat"])
@pytest.mark.parametrize("memory", [None, 1e30])  # dp: the bisection, then the general DP
def test_solvers_price_stages_with_the_chosen_cost_model(solver, memory) -> None:
    """A cut of 1000 B at 100 B/s costs 20 s, all-reduces 10 s: one device is best (2 s), unless
    links are free, when two stages of 1 s are."""
    g = chain([1.0, 1.0], [1000, 1000], [1, 1], [1000, 0])
    cluster = Cluster.parse("2@100B/s", memory=memory)
    plain = pdcompile.plan(g, cluster, solver=solver, num_microbatches=2)
    free = pdcompile.plan(g, cluster, solver=solver, num_microbatches=2,
                          cost_model="test-free-links")  # fmt: skip
    assert [s.replicas for s in plain.stages] == [1]
    assert plain.predicted_time == pytest.approx(2.0)
    assert [s.replicas for s in free.stages] == [1, 1]
    assert free.predicted_time == pytest.approx(1.0)
    assert free.options["cost_model"] == "test-free-links"


@pytest.mark.parametrize("solver", ["dp", "ideal", "cpsat", "pipedream"])
def test_an_unknown_cost_model_is_refused(solver) -> None:
    g = chain([1.0, 1.0], [10, 10], [1, 1], [4, 4])
    with pytest.raises(PartitionError, match="unknown cost model 'nope'"):
        pdcompile.plan(g, Cluster.parse("2"), solver=solver, cost_model="nope")


def test_a_cost_model_file_in_its_package_registers_itself() -> None:
    """`compute-only` is a file in `passes/planning/cost_models/` and on no registry list: free
    links make two stages of 1 s the plan where the default keeps one device."""
    from pdcompile.passes.planning.cost_model import COST_MODELS, cost_models

    assert "compute-only" in cost_models()
    assert "pdcompile.passes.planning.cost_models.compute_only" in COST_MODELS.builtins
    g = chain([1.0, 1.0], [1000, 1000], [1, 1], [1000, 0])
    free = pdcompile.plan(g, Cluster.parse("2@100B/s"), num_microbatches=2,
                          cost_model="compute-only")  # fmt: skip
    assert [s.replicas for s in free.stages] == [1, 1] and free.predicted_time == pytest.approx(1.0)
