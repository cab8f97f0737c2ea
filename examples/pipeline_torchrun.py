"""Train the zoo's GPT-style decoder with `pdcompile.compile`, a stage per process, under torchrun.

    torchrun --standalone --nproc_per_node 2 examples/pipeline_torchrun.py [--schedule 1f1b]

Every rank makes the same `compile` call (same seed, same model, same example); `compile` joins
the job (gloo on CPUs, NCCL on GPUs), captures the model, plans on rank 0 and shares the plan,
and each rank trains its own stage. Rank 0 prints the loss of every step, then `explain()`.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pdcompile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=[*pdcompile.schedules(), "auto"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    # "uniform" cuts one stage per rank; the default solver, PipeDream's dynamic program,
    # prices this small model on a CPU and may well choose data parallelism instead
    parser.add_argument("--solver", default="uniform", choices=list(pdcompile.solvers()))
    args = parser.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(0)
    model = pdcompile.zoo.GPT(pdcompile.zoo.GPTConfig(dropout=0.0)).train()
    tokens = torch.randint(0, 128, (8, 16))  # [batch, sequence]
    targets = torch.roll(tokens, -1, dims=1)  # next-token prediction
    pipe = pdcompile.compile(
        model,
        (tokens,),  # the model in train mode and an example call
        loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        example_targets=targets,  # the loss is priced on the last stage
        cluster=int(os.environ.get("WORLD_SIZE", 1)),  # the ranks of this job
        schedule=args.schedule,
        num_microbatches=args.microbatches,
        solver=args.solver,
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(args.steps):
        loss = pipe.train_step(tokens, targets)  # every rank passes the same global batch
        if rank == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
    pipe.flush()  # streaming schedules (pipedream, 2bw) still have minibatches in flight
    if rank == 0:
        print(pipe.explain())
    pipe.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
