"""Microbatches split unevenly over a stage's replicas (issue 18: 8 microbatches over 3 replicas
split 3/3/2, one rank idled 45% against 18% for the others, and neither the plan nor
`explain()` said so). Microbatch k runs on replica k mod r, so the first M mod r replicas run
ceil(M / r) and the rest floor(M / r); the simulator, and so `Plan.step_time`, charges the
busiest; the plan says so, `plan()` warns, and chooses a count every replica count divides when
the count is its own choice."""

from __future__ import annotations

import warnings

import pytest
import torch
from pipeline_support import OPTIMIZERS, mlp_case

import pdcompile
from pdcompile import Cluster, CostGraph, PartitionError, Plan, PlanWarning, Stage
from pdcompile.cli.handlers import main
from pdcompile.passes.planning.replica_splits import UnevenSplit, replica_split
from pdcompile.passes.planning.solver_kit import settled_microbatches
from pdcompile.scheduling import get_schedule


def chain(times, params, outs) -> CostGraph:
    g = CostGraph(batch_size=8)
    for i, (t, p, o) in enumerate(zip(times, params, outs, strict=True)):
        g.add_node(f"n{i}", forward_s=t / 3, backward_s=2 * t / 3, param_bytes=p, grad_bytes=p,
                   activation_bytes=1, output_bytes=o)  # fmt: skip
        if i:
            g.add_edge(f"n{i - 1}", f"n{i}", outs[i - 1])
    return g


# n0: much compute and no parameters, best on 3 replicas; n1..n3 on the fourth device
SKEWED = chain([10.0, 1.0, 1.0, 1.0], [0, 1000, 1000, 0], [10] * 4)
CLUSTER = "4@100B/s"


def _quiet_plan(*args, **kwargs) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanWarning)  # an even plan warns of nothing
        return pdcompile.plan(*args, **kwargs)


def test_replica_split_is_round_robin() -> None:
    assert replica_split(8, 3) == (3, 3, 2)
    assert replica_split(9, 3) == (3, 3, 3)
    assert replica_split(1, 3) == (1, 0, 0)
    split = UnevenSplit(1, (1, 2, 3), (3, 3, 2))
    assert split.short_ranks == (3,) and split.idle_share == pytest.approx(1 / 3)
    assert split.fixes() == ((9, 12), (1, 2, 4, 8))


@pytest.mark.parametrize("m", [8, 9])
def test_price_and_simulator_for_8_microbatches_over_3_replicas(m: int) -> None:
    """One stage of 3 s per microbatch on 3 replicas: the cost model's steady state is 1 s per
    microbatch (3 s over 3 replicas, `predicted_time`); one step of 8 is 3 microbatches (9 s)
    on the busiest replica, not 8 x 1 s, and the third replica idles a third of it: what
    `step_time`, `rank_idle` and `uneven_splits` say, equal to `simulate`."""
    g = chain([3.0], [0], [0])
    stages = (Stage(index=0, nodes=("n0",), replicas=3, ranks=(0, 1, 2)),)
    plan = pdcompile.evaluate(Plan(stages=stages, cluster="3", num_microbatches=m), g)
    sim = pdcompile.simulate(plan)
    assert plan.predicted_time == pytest.approx(1.0)
    assert plan.step_time == sim.time_per_step == pytest.approx(3.0 * -(-m // 3))
    assert plan.rank_idle == tuple(sim.bubble_fraction)
    if m == 8:
        assert plan.step_time > m * plan.predicted_time
        (split,) = plan.uneven_splits
        assert split.counts == (3, 3, 2) and split.short_ranks == (2,)
        assert plan.rank_idle == pytest.approx((0.0, 0.0, split.idle_share))
        assert str(plan).splitlines()[-1].startswith("note: stage 0's 3 replicas (ranks 0-2)")
    else:
        assert plan.step_time == pytest.approx(m * plan.predicted_time)
        assert plan.uneven_splits == () and "note:" not in str(plan)
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_warns_with_the_split_the_idle_shares_and_the_fix() -> None:
    with pytest.warns(PlanWarning) as caught:
        plan = pdcompile.plan(SKEWED, CLUSTER, num_microbatches=8)
    assert [s.replicas for s in plan.stages] == [3, 1] and plan.num_microbatches == 8
    (warning,) = caught
    text = str(warning.message)
    assert text.startswith(
        "stage 0's 3 replicas (ranks 0-2) split 8 microbatches 3/3/2: rank 2 runs 2 to the "
        "others' 3 and idles 33% of the stage's compute time (simulated idle: rank 2 "
        f"{plan.rank_idle[2]:.0%} against ranks 0-1 {plan.rank_idle[0]:.0%}); use a multiple of 3 "
        "microbatches (e.g. num_microbatches=9 or 12), or replica counts dividing 8 "
        "(replica_counts=(1, 2, 4, 8))"
    )
    assert plan.rank_idle[2] > 2 * plan.rank_idle[0]
    assert str(plan).endswith(f"note: {text}")
    assert caught[0].filename == __file__  # points at the caller


def test_each_way_out_gives_an_even_plan() -> None:
    nine = _quiet_plan(SKEWED, CLUSTER, num_microbatches=9)
    assert [s.replicas for s in nine.stages] == [3, 1] and nine.uneven_splits == ()
    divisors = _quiet_plan(SKEWED, CLUSTER, num_microbatches=8, replica_counts=(1, 2, 4, 8))
    assert all(8 % s.replicas == 0 for s in divisors.stages)
    # plan()'s own choice: twice the devices (8) rounded up to whole rounds of 3 replicas
    chosen = _quiet_plan(SKEWED, CLUSTER)
    assert [s.replicas for s in chosen.stages] == [3, 1] and chosen.num_microbatches == 9
    # per microbatch, the even split beats the uneven one
    with pytest.warns(PlanWarning):
        eight = pdcompile.plan(SKEWED, CLUSTER, num_microbatches=8)
    assert nine.step_time / 9 < eight.step_time / 8


def test_the_count_plan_chooses() -> None:
    rules = get_schedule("1f1b")
    assert settled_microbatches(rules, [1, 3], 8) == 8  # a count the caller gave
    assert settled_microbatches(rules, [1, 3], 8, even=True) == 9
    assert settled_microbatches(rules, [2, 3], 10, even=True) == 12
    # 24 is more than a round of 4 past 14: the split stays uneven (and plan() warns)
    assert settled_microbatches(rules, [3, 4], 14, even=True) == 14
    assert settled_microbatches(get_schedule("2bw"), [3, 1], 8) == 9  # 2bw needs r | M


def test_replica_counts_are_checked() -> None:
    with pytest.raises(PartitionError, match="replica_counts must be a non-empty sequence"):
        pdcompile.plan(SKEWED, CLUSTER, replica_counts=[])
    with pytest.raises(PartitionError, match=r"replica_counts=\(8,\): no stage of a cluster of 4"):
        pdcompile.plan(SKEWED, CLUSTER, replica_counts=(8,))
    with pytest.raises(PartitionError, match="solver 'pipedream' gave stages .3, 1. replicas"):
        pdcompile.plan(SKEWED, CLUSTER, solver="pipedream", replica_counts=(1, 2, 4))


def test_the_plan_command_prints_the_note(capsys, tmp_path) -> None:
    costs = tmp_path / "costs.json"
    SKEWED.save(costs)
    assert main(["plan", str(costs), "--cluster", CLUSTER, "--microbatches", "8"]) == 0
    out, err = capsys.readouterr()
    assert "note: stage 0's 3 replicas (ranks 0-2) split 8 microbatches 3/3/2" in out
    assert "num_microbatches=9 or 12" in out and "PlanWarning" not in err


def test_explain_shows_the_split() -> None:
    model, x, y, loss_fn = mlp_case()
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False)
    with pytest.warns(PlanWarning, match="split 8 microbatches 3/3/2"):
        plan = pdcompile.plan(costs, 3, num_microbatches=8, replica_counts=(3,))
    pipe = pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"],
                             plan=plan)  # fmt: skip
    xs, ys = torch.cat([x, x[:4]]), torch.cat([y, y[:4]])  # 16 rows: 2 per microbatch
    pipe.train_step(xs, ys)
    text = pipe.explain()
    assert "note: stage 0's 3 replicas (ranks 0-2) split 8 microbatches 3/3/2" in text
    assert "rank 2 (stage 0): " in text
    assert "runs 2 of the step's 8 microbatches (stage 0's replicas: 3/3/2)" in text
    assert "runs 3 of the step's 8 microbatches" in text
    assert Cluster.parse("3") == pipe.plan.cluster
