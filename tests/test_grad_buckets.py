"""Replicated stages reduce their gradients in buckets started from the last backward of the step
(`runtime/grad_buckets.py`): where the schedule allows it, and to the same bits as reducing after
the backward, on gloo ranks with gradient accumulation over several microbatches a replica."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pipeline_support import OPTIMIZERS, accumulate_reference, program_for
from spawn import run_ranks

from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline
from pdcompile.runtime.grad_buckets import plan_buckets
from pdcompile.runtime.local import LocalPipeline
from pdcompile.scheduling import build_schedule
from pdcompile.scheduling.reduce_overlap import overlap_triggers

MB = 2**20


def test_buckets_run_backwards_large_alone_small_until_full() -> None:
    sizes = [100, 4 * MB, 100, 4 * MB, 100]  # reversed: 4 alone, 3 alone, then 2, 1, 0...
    assert plan_buckets(sizes) == [[3], [1], [4, 2, 0]]
    assert plan_buckets([10] * 5, cap=20) == [[4, 3], [2, 1], [0]]
    assert plan_buckets([]) == []


def test_triggers_where_every_replica_may_start_early() -> None:
    two_one = build_schedule("1f1b", [(0, 1), (2,)], {(0, 1): True}, 4)
    # replica 0 runs microbatches 0 and 2, replica 1 runs 1 and 3: each its last one's backward
    assert overlap_triggers(two_one.actions) == {(0, 0): 2, (1, 0): 3}
    gpipe = build_schedule("gpipe", [(0, 1)], {}, 4)
    assert overlap_triggers(gpipe.actions) == {(0, 0): 2, (1, 0): 3}
    # a split backward adds gradients outside autograd's accumulation: reduced at the action
    split = build_schedule("zb-h1", [(0, 1), (2,)], {(0, 1): True}, 4)
    assert overlap_triggers(split.actions) == {}
    # two stages of one rank reducing over the same ranks: their hooks would interleave
    both = build_schedule("1f1b", [(0, 1), (0, 1)], {(0, 1): True}, 4)
    assert overlap_triggers(both.actions) == {}


def wide_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Large gradients (reduced in place, 4 MiB each) and small ones (flattened together)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 16), nn.ReLU(),
                          nn.Linear(16, 1024))  # fmt: skip
    return model, torch.randn(16, 1024), torch.randn(16, 1024)


def _train(rank: int, world_size: int, init_file: str, configs: list) -> list:
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    results = []
    for schedule, m, overlap in configs:
        model, x, y = wide_case()
        program = program_for(model, x, [world_size])
        pipeline = DistributedPipeline(
            program, rank=rank, schedule=schedule, num_microbatches=m, loss_fn=F.mse_loss,
            optimizer=OPTIMIZERS["sgd"], device=device, timeout_s=60,
        )  # fmt: skip
        if not overlap:
            pipeline.worker.buckets = None
        losses = [pipeline.train_step((x,), y) for _ in range(3)]
        buckets = pipeline.worker.buckets
        early = None if buckets is None else (buckets.early, len(buckets.buckets))
        params = {n: p.detach().clone() for n, p in pipeline.worker.module.named_parameters()}
        results.append((params, losses, early))
        pipeline.close()
    dist.destroy_process_group()
    return results


def test_bucketed_reduction_equals_the_reduction_after_the_backward() -> None:
    """2 gloo ranks, one stage on both: 2 microbatches a replica accumulate, and only the last
    one's backward starts the buckets; the parameters equal those of the reduction after the
    backward, bit for bit, and the reference's (gradient accumulation in one process)."""
    configs = [("1f1b", 4, True), ("1f1b", 4, False), ("gpipe", 2, True)]
    per_rank = run_ranks(_train, 2, configs, timeout_s=180)
    for rank in range(2):
        (bucketed, losses, early), (after, after_losses, none), (single, _, _) = per_rank[rank]
        assert early == (2, 2) and none is None  # both buckets (4 MiB alone, the rest) early
        assert losses == after_losses
        for name, p in bucketed.items():
            assert torch.equal(p, after[name]), name
            assert torch.equal(p, per_rank[1 - rank][0][0][name]), name  # replicas agree
        model, x, y = wide_case()
        for m, params in ((4, bucketed), (2, single)):
            ref, _ = accumulate_reference(copy.deepcopy(model), x, y, F.mse_loss,
                                          OPTIMIZERS["sgd"], m, 3)  # fmt: skip
            for name, p in ref.named_parameters():
                torch.testing.assert_close(params[name], p, msg=name)


def test_local_executor_reduces_from_the_backward_too() -> None:
    model, x, y = wide_case()
    program = program_for(model, x, [2])
    local = LocalPipeline(program, schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss,
                          optimizer=OPTIMIZERS["sgd"])  # fmt: skip
    for _ in range(3):
        local.train_step((x,), y)
    assert all(w.buckets is not None and w.buckets.early == 2 for w in local.workers.values())
    ref, _ = accumulate_reference(copy.deepcopy(model), x, y, F.mse_loss, OPTIMIZERS["sgd"], 4, 3)
    for module in local.stage_modules().values():
        for name, p in module.named_parameters():
            torch.testing.assert_close(p, dict(ref.named_parameters())[name], msg=name)
