"""Train the zoo's GPT-style decoder as a pipeline, one stage per process, under torchrun.

    torchrun --standalone --nproc_per_node 2 examples/pipeline_torchrun.py [--schedule 1f1b]

Every rank builds the same program (same seed, same trace, same plan: one stage per rank) and
trains its own stage; gloo on CPUs, NCCL on GPUs. Rank 0 prints the loss of every step.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pdcompile
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=list(pdcompile.schedules()))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    device = init_process_group(rank, world_size, timeout_s=120)

    torch.manual_seed(0)
    model = pdcompile.zoo.GPT(pdcompile.zoo.GPTConfig(dropout=0.0)).train()
    tokens = torch.randint(0, 128, (8, 16))
    targets = torch.roll(tokens, -1, dims=1)  # next-token prediction
    gm = pdcompile.trace(model, (tokens,))
    costs = pdcompile.analyze(gm, (tokens,), profile=False)
    plan = pdcompile.plan(costs, pdcompile.Cluster.parse(str(world_size)), solver="uniform")
    pipeline = DistributedPipeline(
        pdcompile.codegen(gm, plan), rank=rank, schedule=args.schedule,
        num_microbatches=args.microbatches,
        loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3), device=device,
    )  # fmt: skip
    for step in range(args.steps):
        loss = pipeline.train_step((tokens,), targets)
        if rank == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
    pipeline.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
