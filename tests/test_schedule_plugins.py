"""Schedules as plugins, several stages per rank, split backward.

The schedules below are registered from this file, without editing the package: they plan,
simulate, validate and train with the local executor and on 2 spawned gloo ranks, equal to
single-process gradient accumulation. A 4-stage plan runs on 2 ranks (2 stages each).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
from pipeline_support import (
    OPTIMIZERS,
    accumulate_reference,
    gpt_case,
    mlp_case,
    program_for,
    stage_parameters,
)
from spawn import run_ranks

import pdcompile
from pdcompile import Cluster, Plan
from pdcompile.runtime import validate_schedule
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline
from pdcompile.runtime.local import LocalPipeline
from pdcompile.scheduling import WarmupSchedule, build_schedule, register_schedule
from pdcompile.scheduling.builder import compute_order


@register_schedule("1f1b-deep")
class DeepWarmup(WarmupSchedule):
    """1F1B with one more warm-up forward per stage (more in flight, the same result)."""

    def warmup(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        return super().warmup(replicas, stage, num_microbatches) + 1


@register_schedule("1f1b-split")
class SplitBackward(WarmupSchedule):
    """1F1B whose backwards are split: each input-gradient part I at once, every weight part W
    at the end of the step."""

    items_per_microbatch = 3

    def compute_item(self, warmup: int, mine: Sequence[int], t: int) -> tuple[str, int]:
        fused = [
            super(SplitBackward, self).compute_item(warmup, mine, i) for i in range(2 * len(mine))
        ]
        order = [("I", k) if kind == "B" else (kind, k) for kind, k in fused]
        return (order + [("W", k) for k in mine])[t]


CASES = {"mlp": mlp_case, "gpt": gpt_case}
SGD = OPTIMIZERS["sgd"]


def four_stages_on_two_ranks(case: str, placement: Sequence[int]) -> pdcompile.StagedProgram:
    """The model cut into 4 stages, stage i on rank placement[i] (2 ranks)."""
    model, x, _, _ = CASES[case]()
    program = program_for(model, x, [1, 1, 1, 1])
    stages = tuple(dataclasses.replace(s, ranks=(placement[s.index],)) for s in program.plan.stages)
    plan = Plan(stages=stages, cluster=Cluster.parse("2"), schedule="gpipe")
    gm = pdcompile.trace(model, (x,))
    return pdcompile.codegen(gm, plan)


def reference(case: str, m: int, steps: int) -> dict[str, torch.Tensor]:
    model, x, y, loss_fn = CASES[case]()
    ref, _ = accumulate_reference(model, x, y, loss_fn, SGD, m, steps)
    return dict(ref.named_parameters(remove_duplicate=False))


def assert_trained(modules: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert modules, "no parameters came back"
    for name, value in modules.items():
        torch.testing.assert_close(value, expected[name], msg=name)


def test_registered_schedules_are_listed_and_built_by_the_shared_builder() -> None:
    listed = pdcompile.schedules()
    assert {"1f1b", "gpipe", "pipedream", "2bw", "1f1b-deep", "1f1b-split"} <= listed.keys()
    assert listed["1f1b-deep"].startswith("1F1B with one more warm-up")
    assert compute_order("1f1b-deep", 2, [0, 1, 2]) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)
    ]  # fmt: skip
    split = build_schedule("1f1b-split", [(0,), (1,)], {(0, 1): True}, 3)
    validate_schedule(split)
    kinds = [a.kind for a in split.actions[0] if a.kind in ("F", "I", "W")]
    assert kinds == ["F", "F", "I", "F", "I", "I", "W", "W", "W"]
    with pytest.raises(pdcompile.ScheduleError, match="unknown schedule 'zz'.*1f1b-deep"):
        build_schedule("zz", [(0,)], {}, 1)


@pytest.mark.parametrize("kind", ["1f1b-deep", "1f1b-split"])
def test_a_registered_schedule_plans_simulates_and_trains_locally(kind: str) -> None:
    model, x, y, loss_fn = mlp_case()
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False)
    # a 2-stage pipeline (not the data-parallel plan the solver may prefer for the MLP)
    plan = pdcompile.plan(costs, "2", schedule=kind, num_microbatches=4, replica_counts=[1])
    assert plan.schedule == kind and plan.num_stages == 2
    sim = pdcompile.simulate(plan)
    assert plan.step_time == sim.time_per_step and plan.rank_memory == tuple(sim.peak_memory)
    deeper = pdcompile.simulate(plan, schedule="1f1b")
    if kind == "1f1b-deep":  # one more activation in flight on the first stage
        assert sim.peak_memory[0] == deeper.peak_memory[0] + plan.stages[0].activation_bytes
    program = pdcompile.codegen(gm, plan)
    pipeline = LocalPipeline(program, schedule=kind, num_microbatches=4, loss_fn=loss_fn,
                             optimizer=SGD)  # fmt: skip
    for _ in range(3):
        pipeline.train_step((x,), y)
    params = {n: p for st in pipeline.stage_modules().values() for n, p in st.named_parameters()}
    assert_trained(params, reference("mlp", 4, 3))


@pytest.mark.parametrize("case", ["mlp", "gpt"])
@pytest.mark.parametrize("placement", [(0, 1, 0, 1), (0, 0, 1, 1)], ids=["interleaved", "blocks"])
def test_four_stages_on_two_ranks_locally(case: str, placement: tuple[int, ...]) -> None:
    _, x, y, loss_fn = CASES[case]()
    program = four_stages_on_two_ranks(case, placement)
    pipeline = LocalPipeline(program, schedule="gpipe", num_microbatches=4, loss_fn=loss_fn,
                             optimizer=SGD)  # fmt: skip
    assert sorted(pipeline.workers) == sorted((r, s) for s, r in enumerate(placement))
    for _ in range(3):
        pipeline.train_step((x,), y)
    params = {
        n: p
        for st in pipeline.stage_modules().values()
        for n, p in st.named_parameters(remove_duplicate=False)
    }
    assert_trained(params, reference(case, 4, 3))


CONFIGS = [  # (case, stage per rank or None for a 2-stage plan, schedule)
    ("mlp", None, "1f1b-deep"),
    ("mlp", None, "1f1b-split"),
    ("mlp", (0, 1, 0, 1), "gpipe"),
    ("gpt", (0, 0, 1, 1), "gpipe"),
]


def _train_on_ranks(rank: int, world_size: int, init_file: str) -> list[dict[str, torch.Tensor]]:
    """Every configuration in one spawned group (the stages train the model's own tensors, so
    each starts from a fresh model)."""
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    results = []
    for case, placement, kind in CONFIGS:
        model, x, y, loss_fn = CASES[case]()
        if placement is None:
            program = program_for(model, x, [1, 1])
        else:
            program = four_stages_on_two_ranks(case, placement)
        pipeline = DistributedPipeline(
            program, rank=rank, schedule=kind, num_microbatches=4, loss_fn=loss_fn,
            optimizer=SGD, device=device, timeout_s=60,
        )  # fmt: skip
        for _ in range(3):
            pipeline.train_step((x,), y)
        results.append(stage_parameters(pipeline))
    dist.destroy_process_group()
    return results


def test_registered_schedules_and_four_stages_on_two_gloo_ranks() -> None:
    per_rank = run_ranks(_train_on_ranks, 2, timeout_s=240)
    for i, (case, _, _) in enumerate(CONFIGS):
        merged = {**per_rank[0][i], **per_rank[1][i]}
        assert_trained(merged, reference(case, 4, 3))
