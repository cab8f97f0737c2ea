"""pdcompile's data-parallel plan against torch's DistributedDataParallel, on 2 gloo CPU ranks.

    python benchmarks/vs_ddp.py [--steps 5] [--rounds 9] [--json out.json]

The model: 8 Linear(1024, 1024) with ReLU between, MSE loss against a random target, a global
batch of 256 rows (128 a rank), SGD(lr=0.01). pdcompile runs the plan of one stage replicated on
both ranks (data parallelism, `1f1b`, one microbatch a replica); torch runs DDP (gloo, its
default buckets: 1 MiB first, then 25 MiB) on a copy of the same parameters. Two gloo ranks, one
thread each; the two runtimes alternate round by round in the same processes, and the benchmark
reports per runtime the median over rounds of wall time per step (rank 0) and the median of the
per-round ratios pdcompile / DDP (below 1: pdcompile faster), and whether the final parameters
agree (allclose).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile import Plan, Stage
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline

ROWS, WIDTH, LAYERS = 256, 1024, 8


def make_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH)]
    for _ in range(LAYERS - 1):
        layers += [nn.ReLU(), nn.Linear(WIDTH, WIDTH)]
    x = torch.randn(ROWS, WIDTH)
    return nn.Sequential(*layers), x, torch.randn(ROWS, WIDTH)


def data_parallel_program(model: nn.Module, x: torch.Tensor) -> pdcompile.StagedProgram:
    """One stage on both ranks: plain data parallelism."""
    gm = pdcompile.trace(model, (x,))
    nodes = tuple(n.name for n in gm.graph.nodes)
    plan = Plan(stages=(Stage(index=0, nodes=nodes, replicas=2, ranks=(0, 1)),), cluster="2",
                num_microbatches=2)  # fmt: skip
    return pdcompile.codegen(gm, plan)


def _timed(run, steps: int) -> float:
    dist.barrier()
    wall = time.perf_counter()
    for _ in range(steps):
        run()
    dist.barrier()
    return (time.perf_counter() - wall) / steps


def _rank(rank: int, world_size: int, init_file: str, steps: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    model, x, y = make_case()
    sgd = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731
    ours = DistributedPipeline(
        data_parallel_program(copy.deepcopy(model), x), rank=rank, schedule="1f1b",
        num_microbatches=2, loss_fn=F.mse_loss, optimizer=sgd, device=device, timeout_s=120,
    )  # fmt: skip
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=dist.new_group())
    opt = sgd(ddp.parameters())
    half = ROWS // world_size
    mine_x, mine_y = x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]

    def ddp_step() -> None:
        loss = F.mse_loss(ddp(mine_x), mine_y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    def our_step() -> None:
        ours.train_step((x,), y)

    our_step()
    ddp_step()
    times: dict[str, list[float]] = {"pdcompile": [], "ddp": []}
    for _ in range(rounds):
        times["pdcompile"].append(_timed(our_step, steps))
        times["ddp"].append(_timed(ddp_step, steps))
    theirs = list(ddp.module.parameters())
    agree = all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-6)
        for a, b in zip(ours.worker.params.values(), theirs, strict=True)
    )
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "agree": agree}, f)
    ours.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per round and runtime")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), args.steps, args.rounds, out),
                 nprocs=2, join=True)  # fmt: skip
        with open(out) as f:
            result = json.load(f)
    times = result["times"]
    ratio = statistics.median(a / b for a, b in zip(times["pdcompile"], times["ddp"], strict=True))
    summary = {
        "pdcompile_ms": statistics.median(times["pdcompile"]) * 1e3,
        "ddp_ms": statistics.median(times["ddp"]) * 1e3,
        "time_ratio": ratio,
        "throughput_vs_ddp": 1 / ratio,
        "parameters_agree": result["agree"],
        "load": os.getloadavg()[0],
    }
    print(
        f"8 x Linear({WIDTH}), {ROWS} rows, 2 gloo ranks, 1 thread each, medians of "
        f"{args.rounds} alternating rounds of {args.steps} steps: pdcompile "
        f"{summary['pdcompile_ms']:.1f} ms / step, DDP {summary['ddp_ms']:.1f} ms; paired "
        f"time ratio {ratio:.3f} (throughput {1 / ratio:.2f}x DDP's); parameters agree: "
        f"{result['agree']}; load {summary['load']:.1f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
