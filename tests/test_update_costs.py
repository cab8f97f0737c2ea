"""What every update runs besides the optimizer step, priced (passes/planning/action_costs.py):
clipping
the gradients' norm (each rank's own sums and scaling, then one number all-reduced over the
clip group) and the non-finite check (one number all-reduced). `compile` marks its plan with
what it runs (`Plan.clip`, `Plan.skip_nonfinite`), so `explain()`'s step time includes them."""

from __future__ import annotations

import pytest
import torch
from pipeline_support import mlp_case

import pdcompile
from pdcompile import Cluster, Plan, Stage, simulate
from pdcompile.core.cluster import RuntimeCosts
from pdcompile.passes.planning.plans import consecutive_ranks

F, B, GRAD, TENSORS = 1.0, 2.0, 300, 4
ALPHA, COLLECTIVE = 0.05, 0.2
COSTS = RuntimeCosts(memory_bandwidth=1000.0, tensor_s=0.01, collective_s=COLLECTIVE)
OWN = 3 * GRAD / 1000.0 + TENSORS * 0.01  # a stage's clip: 3 G / C + n t


def two_stages(**flags: bool) -> Plan:
    ranks = consecutive_ranks([1, 1])
    stages = tuple(
        Stage(index=i, nodes=(f"n{i}",), replicas=1, ranks=ranks[i], forward_s=F, backward_s=B,
              recv_bytes=((0, 10),) if i else (), activation_bytes=10, param_bytes=GRAD,
              grad_bytes=GRAD, weight_bytes=3 * GRAD, param_tensors=TENSORS)
        for i in range(2)
    )  # fmt: skip
    return Plan(stages=stages, cluster=Cluster([(2, 1e30, ALPHA)], runtime=COSTS), **flags)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_a_global_clip_ends_an_all_reduce_after_the_last_rank_s_own_work(kind: str) -> None:
    sim = simulate(two_stages(clip=True), schedule=kind, num_microbatches=4)
    clips = [e for e in sim.timeline if e.kind == "clip"]
    assert sorted(e.rank for e in clips) == [0, 1]
    last = max(e.start for e in clips)  # rank 0, whose last backward ends the step's compute
    assert [e.end for e in clips] == pytest.approx([last + OWN + 2 * ALPHA + COLLECTIVE] * 2)
    plain = simulate(two_stages(), schedule=kind, num_microbatches=4)
    assert sim.time_per_step > plain.time_per_step + OWN + 2 * ALPHA + COLLECTIVE - 1e-9


def test_a_check_is_one_number_all_reduced() -> None:
    sim = simulate(two_stages(skip_nonfinite=True), schedule="1f1b", num_microbatches=2)
    checks = [e for e in sim.timeline if e.kind == "check"]
    last = max(e.start for e in checks)
    assert [e.end for e in checks] == pytest.approx([last + 2 * ALPHA + COLLECTIVE] * 2)


def test_pipedream_clips_each_stage_alone() -> None:
    sim = simulate(two_stages(clip=True), schedule="pipedream", num_microbatches=2)
    clips = [e for e in sim.timeline if e.kind == "clip"]
    assert clips and all(e.duration == pytest.approx(OWN) for e in clips)


def test_compile_prices_the_clip_it_runs() -> None:
    model, x, _, loss_fn = mlp_case()
    cluster = Cluster([(2, 1e10, 1e-4)], runtime=RuntimeCosts(1e10, 1e-6, collective_s=1e-4))
    args = dict(loss_fn=loss_fn, profile=False, cluster=cluster, num_microbatches=2,
                optimizer=lambda p: torch.optim.SGD(p, lr=0.01))  # fmt: skip
    clipped = pdcompile.compile(model, (x[:4],), clip_grad_norm=1.0, **args)
    plain = pdcompile.compile(model, (x[:4],), **args)
    assert clipped.plan.clip and not plain.plan.clip
    assert clipped.plan.step_time > plain.plan.step_time
    assert Plan.from_json(clipped.plan.to_json()).clip
