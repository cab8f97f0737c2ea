"""The distributed executor on 2, 3 and 4 gloo ranks in spawned processes, against the
single-process references and the local executor (several configurations per spawned group:
spawning costs seconds)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from pipeline_support import (
    CASES,
    OPTIMIZERS,
    STEP_LR,
    accumulate_reference,
    one_thread,
    pipedream_reference,
    program_for,
    two_bw_run,
)
from spawn import run_ranks

from pdcompile.core.errors import PipelineTimeoutError
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline
from pdcompile.runtime.local import LocalPipeline

# (case, replicas, schedule, optimizer, microbatches, steps[, clip_grad_norm with StepLR])
TWO_RANKS = [
    ("mlp", [1, 1], "1f1b", "sgd", 4, 5),
    ("resnet", [1, 1], "gpipe", "adam", 4, 5),
    ("mlp", [1, 1], "pipedream", "sgd", 2, 5),
]
THREE_RANKS = [
    ("mlp", [2, 1], "1f1b", "adam", 4, 5),
    ("gpt", [1, 1, 1], "1f1b", "sgd", 4, 5),
    ("mlp", [2, 1], "pipedream", "sgd", 2, 5),
    ("gpt", [1, 1, 1], "pipedream", "sgd", 3, 4),
    ("gpt", [1, 1, 1], "1f1b", "sgd", 4, 4, 0.05),  # global clipping over tied copies
    ("mlp", [2, 1], "2bw", "sgd", 4, 4),  # steps stream across calls, a replicated stage
    ("gpt", [1, 1, 1], "2bw", "sgd", 3, 4, 0.05),  # streaming with global clipping and ties
    ("gpt", [1, 1, 1], "pipedream", "sgd", 3, 4, 0.05),  # tied stages 0 and 2 clip together
]
FOUR_RANKS = [
    ("unet", [1, 1, 1, 1], "1f1b", "sgd", 4, 5),
    ("mlp", [2, 1, 1], "gpipe", "sgd", 4, 5),
    ("mlp", [2, 1, 1], "1f1b", "sgd", 4, 4, 0.05),  # global clipping over replicas
]


def _train(rank: int, world_size: int, init_file: str, configs) -> list:
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    results = []
    for case, replicas, schedule, optimizer, m, steps, *clip in configs:
        model, x, y, loss_fn = CASES[case]()
        program = program_for(model, x, replicas)
        pipeline = DistributedPipeline(
            program, rank=rank, schedule=schedule, num_microbatches=m, loss_fn=loss_fn,
            optimizer=OPTIMIZERS[optimizer], device=device, timeout_s=60,
            **_clipping(clip),
        )  # fmt: skip
        losses, pending = [], 0  # sends not yet known received, after each call
        for _ in range(steps):
            losses.append(pipeline.train_step((x,), y))
            pending = max(pending, pipeline.comm.pending_sends)
        pipeline.flush()
        params = {n: p.detach().clone() for n, p in pipeline.worker.module.named_parameters()}
        results.append((params, losses, pending))
    dist.destroy_process_group()
    return results


def _clipping(clip: list) -> dict:
    return {"clip_grad_norm": clip[0], "lr_scheduler": STEP_LR} if clip else {}


@one_thread()
def _expected(case, replicas, schedule, optimizer, m, steps, *clip):
    """Reference parameters by name, and the local executor's per rank (at one thread, as the
    ranks run)."""
    model, x, y, loss_fn = CASES[case]()
    program = program_for(model, x, replicas)
    extra = {"clip": clip[0], "scheduler": STEP_LR} if clip else {}
    if schedule == "pipedream":
        stages = pipedream_reference(program, x, y, loss_fn, OPTIMIZERS[optimizer], m, steps,
                                     **extra)  # fmt: skip
        reference = {n: p for stage in stages for n, p in stage.named_parameters()}
    elif schedule == "2bw":
        ref, _ = two_bw_run(model, [(x, y)] * steps, loss_fn, OPTIMIZERS[optimizer], m, **extra)
        reference = dict(ref.named_parameters(remove_duplicate=False))
    else:
        ref, _ = accumulate_reference(
            model, x, y, loss_fn, OPTIMIZERS[optimizer], m, steps, **extra
        )
        reference = dict(ref.named_parameters(remove_duplicate=False))
    local = LocalPipeline(
        program, schedule=schedule, num_microbatches=m, loss_fn=loss_fn,
        optimizer=OPTIMIZERS[optimizer], **_clipping(list(clip)),
    )  # fmt: skip
    losses = [local.train_step((x,), y) for _ in range(steps)]
    local.flush()
    return reference, local.stage_modules(), losses


@pytest.mark.parametrize("configs", [TWO_RANKS, THREE_RANKS, FOUR_RANKS], ids=["2", "3", "4"])
def test_distributed_training_equals_the_references_and_the_local_executor(configs) -> None:
    world_size = sum(configs[0][1])
    assert all(sum(c[1]) == world_size for c in configs)
    per_rank = run_ranks(_train, world_size, configs, timeout_s=240)
    for i, config in enumerate(configs):
        reference, local, local_losses = _expected(*config)
        for rank in range(world_size):
            params, losses, pending = per_rank[rank][i]
            # a streaming call leaves pending only sends its peers receive in the next call
            # (synchronous steps: none); were they never waited on, they would pile up
            assert pending <= (config[4] if config[2] in ("pipedream", "2bw") else 0), config
            (local_module,) = [m for (r, _), m in local.items() if r == rank]
            local_params = dict(local_module.named_parameters())
            for name, p in params.items():
                where = f"{config}, rank {rank}: {name}"
                torch.testing.assert_close(p, reference[name], msg=where)
                torch.testing.assert_close(p, local_params[name], msg=where)
            assert losses == pytest.approx(local_losses, rel=1e-5), config


def _die(rank: int, world_size: int, init_file: str) -> str:
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=10)
    model, x, y, loss_fn = CASES["mlp"]()
    pipeline = DistributedPipeline(
        program_for(model, x, [1, 1, 1]), rank=rank, schedule="1f1b", num_microbatches=4,
        loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"], device=device, timeout_s=10,
    )  # fmt: skip
    pipeline.train_step((x,), y)
    if rank == 2:
        os._exit(1)  # a worker dies mid-run
    pipeline.train_step((x,), y)
    return "finished"


def test_a_dead_rank_stops_the_others_with_a_timeout_error() -> None:
    # rank 1 sees rank 2 die; rank 0 hears of it from rank 1, as the same class
    outcomes = run_ranks(_die, 3, timeout_s=120, allow_failures=True)
    for survivor in outcomes[:2]:
        assert survivor.error == PipelineTimeoutError.__name__, survivor
        assert "rank 2" in survivor.message, survivor.message
