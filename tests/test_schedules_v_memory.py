"""`v-half` and `v-min` hold about 1/2 and 1/3 of 1F1B's activations (Qi et al., NeurIPS'24).

Fair comparison on one model: 1F1B on p ranks, each stage two chunks of the model (F, I, W of
2 s, activations 2A per microbatch), against the V on 2p stages of one chunk each (1 s, A).
Peaks are simulated (`pdcompile.simulate`), with no weights, so they are activations alone.
Each rank of a V holds at most its cap of microbatch-chunks; 1F1B's first rank holds p
microbatches, 2p chunks. Measured (F = I = W; bubble the largest rank's):

| p | M | 1f1b bubble | v-half peak, bubble | v-min peak, bubble |
|---|---|---|---|---|
| 4 | 16 | 15.8% | 0.75x, 8.6% | 0.50x, 33.8% |
| 8 | 32 | 17.9% | 0.625x, 10.7% | 0.50x, 21.0% |

The issue's 0.55x and 0.40x are below the paper's own counts ((p + 2) // 2 and (p + 4) // 3
microbatches against 1F1B's p) at p = 4 and 8: they are met from p = 16 on for v-min
(0.375x) and approached by v-half (0.5625x).
"""

from __future__ import annotations

import functools
import warnings

import pytest

import pdcompile
from pdcompile import Cluster, Plan, Stage
from pdcompile.scheduling import get_schedule

ACT = 100  # bytes of activations per microbatch of one chunk of the model


def plan_of(ranks: list[tuple[int, ...]], seconds: float, activations: int) -> Plan:
    """Stages of F = I = W = `seconds` holding `activations` per microbatch, no weights, on
    `ranks`, transfers taking no time."""
    stages = tuple(
        Stage(index=s, nodes=(f"n{s}",), replicas=1, ranks=r, forward_s=seconds,
              backward_s=2 * seconds, backward_input_s=seconds, backward_weight_s=seconds,
              recv_bytes=((s - 1, 1000),) if s else (), activation_bytes=activations,
              param_bytes=0, grad_bytes=0, weight_bytes=0)
        for s, r in enumerate(ranks)
    )  # fmt: skip
    return Plan(stages=stages, cluster=Cluster([(len(set(ranks)), 1e30)]))


def measured(kind: str, p: int, m: int) -> tuple[float, float]:
    """(peak activations against 1F1B's, largest bubble) of `kind` on p ranks, M = m."""
    base = pdcompile.simulate(plan_of([(s,) for s in range(p)], 2.0, 2 * ACT), schedule="1f1b",
                              num_microbatches=m)  # fmt: skip
    rules = get_schedule(kind)
    v = [(rules.chunk_rank(s, p, 2),) for s in range(2 * p)]
    sim = pdcompile.simulate(plan_of(v, 1.0, ACT), schedule=kind, num_microbatches=m)
    return max(sim.peak_memory) / max(base.peak_memory), max(sim.bubble_fraction)


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize(("kind", "count"), [("v-half", lambda p: (p + 2) // 2),
                                             ("v-min", lambda p: (p + 4) // 3)])  # fmt: skip
def test_peak_activations_are_the_papers_share_of_1f1bs(kind: str, count: object, p: int) -> None:
    for m in (2 * p, 4 * p):
        ratio, _ = measured(kind, p, m)
        assert ratio == pytest.approx(count(p) / p), (kind, p, m)  # type: ignore[operator]


def test_the_shares_reach_the_papers_half_and_third_as_p_grows() -> None:
    assert measured("v-min", 16, 32)[0] <= 0.40
    assert measured("v-half", 16, 32)[0] <= 0.57


@pytest.mark.parametrize("p", [4, 8])
def test_v_half_idles_less_than_1f1b(p: int) -> None:
    one = pdcompile.simulate(plan_of([(s,) for s in range(p)], 2.0, 2 * ACT), schedule="1f1b",
                             num_microbatches=4 * p)  # fmt: skip
    _, bubble = measured("v-half", p, 4 * p)
    assert bubble < max(one.bubble_fraction)


def test_it_plans_on_a_chain() -> None:
    costs = pdcompile.CostGraph.load("docs/pictures/chain8.json")
    for kind in ("v-half", "v-min"):
        plan = pdcompile.plan(costs, "4", solver="uniform", schedule=kind)
        assert [s.ranks[0] for s in plan.stages] == [0, 1, 2, 3, 3, 2, 1, 0]
        assert plan.step_time == pdcompile.simulate(plan).time_per_step


def test_under_a_limit_only_1f1b_with_recomputation_met_auto_takes_v_half_without_it() -> None:
    """8 equal layers on 4 ranks, M = 8, memory 0.8x 1F1B's peak: 1F1B fits only by
    recomputing a stage; v-half fits as it is, faster, and schedule="auto" chooses it."""
    costs = pdcompile.CostGraph.load("docs/pictures/chain8.json")
    plan = functools.partial(pdcompile.plan, costs, solver="uniform", num_microbatches=8)
    peak = max(plan("4", schedule="1f1b", recompute=False).rank_memory)
    limited = Cluster.parse("4", memory=0.8 * peak)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one, half, auto = (plan(limited, schedule=k) for k in ("1f1b", "v-half", "auto"))
    assert any(s.recompute for s in one.stages)
    assert half.fits_memory and not any(s.recompute for s in half.stages)
    assert half.step_time < one.step_time
    assert auto.schedule == "v-half" and auto.step_time <= half.step_time
