"""The memory the solvers charge a stage (`memory_counts`, `memory_bounds`) against the
simulator's, the W's the split-backward schedules (`zb-h1`, `zb-h2`) leave pending included."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ideal_cpsat import brute_force, clusters, costs, solve
from test_solvers import chain as solvers_chain
from test_solvers import skeleton

import pdcompile
from pdcompile import Cluster, CostGraph, PartitionError, evaluate
from pdcompile.scheduling import get_schedule

SOLVERS = ("dp", "ideal", "cpsat")
SPLIT = ("zb-h1", "zb-h2")


def chain(acts: list[int], kept: list[int]) -> CostGraph:
    """Nodes of equal time and weights in a line, node i keeping `kept[i]` of its `acts[i]`
    activation bytes from its I to its W."""
    g = CostGraph(batch_size=8)
    for i, (a, k) in enumerate(zip(acts, kept, strict=True)):
        g.add_node(f"n{i}", forward_s=1 / 3, backward_s=2 / 3, param_bytes=10, grad_bytes=10,
                   activation_bytes=a, weight_grad_activation_bytes=k, output_bytes=8)  # fmt: skip
        if i:
            g.add_edge(f"n{i - 1}", f"n{i}", 8)
    return g


def layouts(nodes: int, devices: int):
    """(cuts, replicas) of every contiguous plan of `nodes` nodes on at most `devices`."""
    for count in range(1, min(nodes, devices) + 1):
        for cuts in itertools.combinations(range(1, nodes), count - 1):
            for replicas in itertools.product(range(1, devices + 1), repeat=count):
                if sum(replicas) <= devices:
                    yield cuts, replicas


def warmups(replicas: tuple[int, ...]) -> list[int]:
    return [(sum(replicas[s:]) - 1) // r for s, r in enumerate(replicas)]


def charged(stage, counts) -> int:
    """The bytes `counts` charge one replica of `stage`, as the solvers add them up (a
    microbatch whose W is pending at all its activations)."""
    return max(counts.charges(
        stage.weight_bytes, stage.grad_bytes, stage.param_bytes, stage.activation_bytes,
        stage.activation_bytes,
    ))  # fmt: skip


# -- (a) the solvers' plans fit in simulation ----------------------------------------------

G = chain([100] * 8, [60] * 8)  # 8 equal nodes; W keeps 60 of each one's 100 activation bytes
CLUSTER, M = "4@1GB/s", 8
# where nothing fits in simulation (zb-h1 at 600 B, zb-h2 at 760 B) the solvers, counting
# only the microbatches whose I is pending, used to return plans that do not fit (zb-h1:
# stages of 2, 2 and 4 nodes on 2, 1, 1 replicas, simulated 720 B; zb-h2: 2 and 6 nodes on 2
# and 2 replicas, 1440 B); at 660 B zb-h1 fits 2, 5 and 1 nodes on 2, 1, 1 replicas (660 B)
LIMITS = {"zb-h1": (600, 660, 840, 900), "zb-h2": (760, 960, 1300)}


@pytest.fixture(scope="module")
def simulated_layouts() -> dict[str, list[tuple[float, int]]]:
    """Per split schedule, (predicted time, simulated peak memory) of every plan of `G`."""
    out = {}
    for schedule in SPLIT:
        out[schedule] = []
        for cuts, replicas in layouts(len(G.nodes), 4):
            if get_schedule(schedule).accepts(replicas, M):
                plan = skeleton(G, Cluster.parse(CLUSTER), cuts, replicas, schedule, M)
                scored = evaluate(plan, G)
                out[schedule].append((scored.predicted_time, max(scored.rank_memory)))
    return out


@pytest.mark.filterwarnings("ignore::pdcompile.PlanWarning")
@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize(("schedule", "memory"), [(s, m) for s in SPLIT for m in LIMITS[s]])
def test_split_schedule_plans_fit_the_simulated_memory(
    simulated_layouts, schedule: str, memory: int, solver: str
) -> None:
    """Each solver's plan fits its simulated memory and is the fastest that does (brute
    force), or it finds none, saying so: dp and ideal, which take the deepest warm-up before a
    stage to be the devices' (D - 1), may miss a plan whose first stage is replicated; cpsat,
    which encodes the layout's, finds the best whenever one fits."""
    best = min((t for t, peak in simulated_layouts[schedule] if peak <= memory), default=None)
    cluster = Cluster.parse(CLUSTER, memory=memory)
    try:
        plan = pdcompile.plan(G, cluster, solver=solver, schedule=schedule, num_microbatches=M,
                              recompute=False)  # the solvers' own plans  # fmt: skip
    except PartitionError as exc:
        assert "no placement fits" in str(exc)
        assert best is None or solver != "cpsat"
        return
    assert plan.fits_memory, (max(plan.rank_memory), memory)
    assert plan.predicted_time == pytest.approx(best, rel=1e-6)  # cpsat's ticks: 1e-6


# -- (b) the counts bound the simulator's memory on every schedule -------------------------

# (the check on every registered schedule: tests/test_schedule_conformance.py, with these)
REPLICAS = [(1,), (1, 1), (1, 1, 1), (1, 1, 1, 1), (2,), (4,), (2, 1), (1, 2), (3, 1), (1, 3),
            (2, 2), (2, 1, 1), (1, 2, 1), (1, 1, 2)]  # fmt: skip
# per node (activation bytes, of them kept until W): unequal stages, W keeping none, some, all
BYTES = [[(100, 60), (300, 10), (50, 50), (200, 0)], [(70, 0), (70, 70), (400, 390), (10, 5)]]


@pytest.mark.parametrize("schedule", SPLIT)
def test_counts_split_the_peak_into_i_and_w_pending(schedule: str) -> None:
    """Stage s of a straight pipeline of p: zb-h1 holds p - s microbatches whose I is pending
    and s whose W alone is, zb-h2 2p - 1 - 2s and 2s (M large enough), the same peak of
    microbatches on every stage as `in_flight_bound`, also while the gradients are held (the
    peak comes after the first W)."""
    rules, p, m = get_schedule(schedule), 4, 16
    factor = 2 if schedule == "zb-h2" else 1
    for s in range(p):
        counts = rules.memory_counts(p - s, p - 1 - s, m, p - 1)
        assert counts[:3] == (factor * (p - 1 - s) + 1, factor * s, 0)
        assert counts.graded == counts[:2]
        assert sum(counts[:3]) == rules.in_flight_bound([1] * p, s, m)


@pytest.mark.filterwarnings("ignore::pdcompile.PlanWarning")
@settings(deadline=None, max_examples=40)
@given(n=st.integers(1, 5), costs=costs, kept=st.lists(st.floats(0, 1), min_size=5, max_size=5),
       cluster=clusters(4, memory=True), schedule=st.sampled_from(SPLIT),
       m=st.integers(0, 4))  # fmt: skip
def test_cpsat_encodes_the_deepest_warmup_exactly(n, costs, kept, cluster, schedule, m) -> None:
    """cpsat equals brute force under the counts of each layout's own warm-ups (the deepest
    included), which bound the simulated memory; dp's plan is no better and fits too."""
    m += 2 * cluster.num_devices - 1 if schedule == "zb-h2" else 1  # what zb-h2 fills
    times, params, acts = zip(*costs[:n], strict=True)
    g = solvers_chain(times, params, acts, [10 * i for i in range(n)])
    for node, share in zip(g.nodes, kept, strict=False):
        g.graph.nodes[node]["weight_grad_activation_bytes"] = int(
            share * g.graph.nodes[node]["activation_bytes"]
        )
    best = brute_force(g, cluster, schedule, m)
    for solver in ("cpsat", "dp"):
        try:
            plan = solve(g, cluster, solver, schedule, m)  # asserts `fits_memory`
        except PartitionError as exc:
            assert "no placement fits" in str(exc)
            assert best == math.inf or solver == "dp"
            continue
        assert best <= plan.predicted_time * (1 + 1e-12)
        if solver == "cpsat":  # the documented rounding: within 4 ticks of the best
            assert plan.options["bound"] <= best * (1 + 1e-12)
            assert plan.predicted_time <= plan.options["bound"] + 4 * plan.options["tick_s"]
