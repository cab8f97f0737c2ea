"""Draw docs/pictures/measured_vs_simulated.png: a real 2-rank run above its simulation.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 \
        docs/pictures/measured_vs_simulated.py [--schedule 1f1b] [--microbatches 8]

Both ranks train an MLP cut in two stages by `blocks` on profiled costs (gloo on CPUs, one
thread each). After warm-up steps every rank calls `save_trace` for the last step; rank 0 saves
the plan and draws the measured step above the plan's simulation with
`pdcompile simulate PLAN --measured TRACE --png FILE`.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile.cli.handlers import main as pdcompile_cli
from pdcompile.runtime.distributed import init_process_group

HERE = os.path.dirname(os.path.abspath(__file__))


def mlp(width: int = 1024, depth: int = 4) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=list(pdcompile.schedules()))
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="the last one is drawn")
    parser.add_argument("--out", default=os.path.join(HERE, "measured_vs_simulated.png"))
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    init_process_group(rank, world_size, timeout_s=300)

    torch.manual_seed(0)
    x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))
    # the example is one microbatch: the plan's costs, which simulate takes, are per microbatch
    microbatch = x[: len(x) // args.microbatches]
    pipe = pdcompile.compile(
        mlp(), (microbatch,), loss_fn=F.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        schedule=args.schedule, num_microbatches=args.microbatches, solver="blocks",
    )  # fmt: skip
    for _ in range(args.steps):
        pipe.train_step(x, y)
    trace, plan = os.path.join(HERE, "measured_trace.json"), os.path.join(HERE, "plan.json")
    pipe.save_trace(trace, steps=1)  # every rank: gathered to rank 0, which writes
    print(pipe.explain(), flush=True)
    if rank == 0:
        pipe.plan.save(plan)
        pdcompile_cli(["simulate", plan, "--measured", trace, "--png", args.out])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
