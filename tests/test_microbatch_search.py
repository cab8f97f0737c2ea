"""`plan(..., global_batch_size=G)` (issue 19): the microbatch count is searched with the
partition, for one schedule or with `schedule="auto"` for every candidate; the plan returned is
the fastest fitting one of the plans at each count, by construction."""

from __future__ import annotations

import time
import warnings

import pytest

import pdcompile
from pdcompile import Cluster, CostGraph, PartitionError, Plan, PlanWarning
from pdcompile.cli.handlers import main
from pdcompile.core.cluster import RuntimeCosts
from pdcompile.passes.planning.microbatch_count import MAX_COUNTS, TIE, batch_settings, divisors
from pdcompile.passes.planning.schedule_choice import auto_table, candidates, layouts

EQUAL = CostGraph.load("docs/pictures/chain8.json")  # 8 equal layers, batch 8
G = 64
# each message costs 2 ms of a rank's time: more microbatches shrink the bubble but pay more
# messages, so the fastest count is neither the fewest nor the most
BUSY = Cluster.parse("4@10GB/s+1ms", runtime=RuntimeCosts(message_s=2e-3))


def _plan(costs: CostGraph, cluster: Cluster | str, **kwargs) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        return pdcompile.plan(costs, cluster, **kwargs)


def _each_count(costs: CostGraph, cluster: Cluster | str, **kwargs) -> dict[int, Plan]:
    """The plan at every count dividing G, planned alone (those that cannot be left out)."""
    out = {}
    for m in divisors(G):
        try:
            out[m] = _plan(costs, cluster, num_microbatches=m, microbatch_size=G // m, **kwargs)
        except PartitionError:
            continue
    return out


def _fastest_fitting(plans: dict) -> float:
    fitting = [p for p in plans.values() if p.fits_memory] or list(plans.values())
    return min(p.step_time for p in fitting)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "zb-v"])
def test_the_count_chosen_is_the_fastest_of_the_plans_at_every_count(schedule: str) -> None:
    chosen = _plan(EQUAL, BUSY, schedule=schedule, global_batch_size=G)
    each = _each_count(EQUAL, BUSY, schedule=schedule)
    assert chosen.step_time == pytest.approx(_fastest_fitting(each), rel=TIE)
    assert chosen.num_microbatches * chosen.microbatch_size == G
    same = each[chosen.num_microbatches]
    assert [s.nodes for s in same.stages] == [s.nodes for s in chosen.stages]
    rows = {r["num_microbatches"]: r for r in chosen.options["microbatches"]}
    assert sorted(rows) == divisors(G) and chosen.options["global_batch_size"] == G
    for m, row in rows.items():  # each row is what plan() gives at that count alone
        if row["skipped"]:
            assert m not in each
        else:
            assert row["step_time"] == each[m].step_time and row["microbatch_size"] == G // m
    assert sum(r["chosen"] for r in rows.values()) == 1 and rows[chosen.num_microbatches]["chosen"]


def test_message_costs_make_the_fastest_count_an_inner_one() -> None:
    chosen = _plan(EQUAL, BUSY, global_batch_size=G)
    tried = [r["num_microbatches"] for r in chosen.options["microbatches"] if not r["skipped"]]
    assert min(tried) < chosen.num_microbatches < max(tried)
    free = _plan(EQUAL, "4@10GB/s", global_batch_size=G)  # free messages: the smallest bubble
    assert free.num_microbatches == G


def test_a_memory_limit_that_only_smaller_microbatches_fit() -> None:
    """Under 1F1B the activations in flight shrink with the microbatch: no plan of 8
    microbatches of 8 rows fits 120 MB (a layer holds 50 MB per microbatch of 8 rows), smaller
    microbatches do, and the search finds them."""
    cluster = Cluster.parse("4@10GB/s", memory=120e6, runtime=RuntimeCosts(message_s=2e-3))
    with pytest.raises(PartitionError, match="no placement fits"):
        _plan(EQUAL, cluster, num_microbatches=8, microbatch_size=8, recompute=False)
    chosen = _plan(EQUAL, cluster, global_batch_size=G, recompute=False)
    assert chosen.fits_memory and chosen.num_microbatches > 8
    assert max(chosen.rank_memory) <= cluster.memory


def test_auto_searches_schedule_chunks_and_count_together() -> None:
    chosen = _plan(EQUAL, BUSY, schedule="auto", global_batch_size=G)
    every = {}
    for name, v in candidates():
        for counts in layouts(BUSY.num_devices, v, None):
            plans = _each_count(EQUAL, BUSY, schedule=name, chunks=v, replica_counts=counts)
            for m, p in plans.items():
                every[name, v, counts, m] = p
    if chosen.schedule in {name for name, _ in candidates()}:  # not synth fitted to the best
        assert chosen.step_time == pytest.approx(_fastest_fitting(every), rel=TIE)
    assert all(chosen.step_time <= p.step_time * (1 + TIE) for p in every.values())
    rows = chosen.options["auto"]
    (row,) = [r for r in rows if r["chosen"]]
    assert (row["schedule"], row["num_microbatches"]) == (chosen.schedule, chosen.num_microbatches)
    for r in rows[: len(candidates())]:  # the best count of each (schedule, chunks)
        mine = {k: p for k, p in every.items() if k[:2] == (r["schedule"], r["chunks"])}
        assert r["step_time"] == pytest.approx(_fastest_fitting(mine), rel=TIE)
        assert set(r["counts_tried"]) <= {k[3] for k in mine}
    assert "M microbatches of the 64 rows per step" in auto_table(chosen)


def test_a_given_count_or_size_fixes_the_split() -> None:
    assert batch_settings(EQUAL, 64, 16, None) == [(16, 4)]
    assert batch_settings(EQUAL, 64, None, 16) == [(4, 16)]
    assert batch_settings(EQUAL, 12, None, None) == [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2),
                                                     (12, 1)]  # fmt: skip
    plan = _plan(EQUAL, "4", global_batch_size=64, num_microbatches=16)
    assert (plan.num_microbatches, plan.microbatch_size) == (16, 4)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"global_batch_size": 0}, "integer >= 1"),
        ({"global_batch_size": 64, "num_microbatches": 6}, "does not divide"),
        ({"global_batch_size": 64, "microbatch_size": 5}, "does not divide"),
        ({"global_batch_size": 64, "num_microbatches": 4, "microbatch_size": 8}, "give two"),
        ({"global_batch_size": 3, "schedule": "zb-h2"}, "no microbatch count"),
    ],
)
def test_bad_batches_are_clear_errors(kwargs: dict, words: str) -> None:
    with pytest.raises(PartitionError, match=words):
        _plan(EQUAL, "4", **kwargs)


@pytest.mark.timeout(20)
def test_a_huge_batch_is_refused_or_searched_among_a_few_counts_at_once() -> None:
    """Issue 31: 2**61 and 10**30 never returned (divisors enumerated up to the square root),
    10**12 planned 63 counts (24 s)."""
    start = time.perf_counter()
    for huge in (2**61, 10**30):
        with pytest.raises(PartitionError, match=r"at most 2\*\*53"):
            batch_settings(EQUAL, huge, None, None)
    settings = batch_settings(EQUAL, 10**12, None, None)
    assert len(settings) == MAX_COUNTS and settings[0] == (1, 10**12), settings
    assert settings[-1] == (64000, 10**12 // 64000), settings  # the largest divisor up to the cap
    assert len(divisors(2**53)) == 17 and time.perf_counter() - start < 1


def test_a_graph_without_a_batch_size_cannot_be_split() -> None:
    costs = CostGraph.load("docs/pictures/chain8.json")
    costs.batch_size = None
    with pytest.raises(PartitionError, match="batch_size"):
        _plan(costs, "4", global_batch_size=64)


def test_plan_command_searches_the_count_of_a_global_batch(capsys) -> None:
    code = main(["plan", "docs/pictures/chain8.json", "--cluster", "4@10GB/s+1ms",
                 "--global-batch-size", "16"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "microbatch counts of the 16 rows per step" in out
    assert all(f"M={m} x {16 // m} rows" in out for m in divisors(16))
    code = main(["plan", "docs/pictures/chain8.json", "--cluster", "4", "--schedule", "auto",
                 "--global-batch-size", "16"])  # fmt: skip
    assert code == 0 and "M microbatches of the 16 rows per step" in capsys.readouterr().out
    assert main(["plan", "docs/pictures/chain8.json", "--cluster", "4",
                 "--global-batch-size", "16", "--microbatches", "3"]) == 1  # fmt: skip
    assert "does not divide" in capsys.readouterr().err
