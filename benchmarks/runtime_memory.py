"""What the runtime holds beyond the model: each rank's resident set (RSS) against the plan.

    python benchmarks/runtime_memory.py [--ranks 4] [--width 1024] [--layers 8]
        [--microbatches 64] [--rows 16] [--steps 30] [--warmup 3] [--schedule 1f1b]
        [--json benchmarks/results/runtime_memory.json]

A `(Linear(width, width), ReLU) x layers` MLP on `--ranks` spawned gloo ranks (one stage each,
a `FileStore` rendezvous), `--microbatches` microbatches of `--rows` rows per step, SGD with
momentum. Per rank: `Plan.rank_memory` (the model: weights, activations and the message
buffers), the memory probe's peak (its parts) and its message buffers in use at once, and the
RSS (`/proc/self/statm`) after the compile, after `--warmup` steps and after all steps, and its
peak (VmHWM); growth is the RSS after all steps less the RSS after the compile; "late" the RSS
after all steps less the RSS after the warm-up (a leak or a cache that keeps growing); "peak
growth" the peak less the RSS after the compile; "beyond plan" the peak growth less what the
plan adds after the compile (`Plan.rank_memory` less the rank's parameters, resident since the
compile): what the model leaves out. `--no-pool`: a fresh buffer per message (before
`runtime/message_pool.py`); `--glibc-default`: glibc's moving mmap threshold (before
`runtime/host_heap.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile.runtime import distributed, host_heap
from pdcompile.runtime.distributed import init_process_group

MIB = 2**20


def rss() -> int:
    """This process's resident set, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _rank(rank: int, args: argparse.Namespace, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    if args.no_pool:
        distributed.MessagePool = lambda: None  # noqa: E731
    if args.glibc_default:
        host_heap.ENABLED = False
    init_process_group(rank, args.ranks, init_file=init_file, backend="gloo", timeout_s=300)
    torch.manual_seed(0)
    layers = [m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.ReLU())]
    model = nn.Sequential(*layers)
    rows = args.rows * args.microbatches
    x, y = torch.randn(rows, args.width), torch.randn(rows, args.width)
    sgd = lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)  # noqa: E731
    with pdcompile.compile(
        model, (x[: args.rows],), loss_fn=F.mse_loss, optimizer=sgd, cluster=str(args.ranks),
        schedule=args.schedule, num_microbatches=args.microbatches, profile=False,
        solver="blocks", measure_memory=True, global_batch_size=rows,
    ) as pipe:  # fmt: skip
        samples, times = [rss()], []
        for step in range(args.steps):
            t0 = time.perf_counter()
            pipe.train_step(x, y)
            times.append(time.perf_counter() - t0)
            samples.append(rss())
            if step + 1 == args.warmup:
                warm = samples[-1]
        plan = pipe.plan
        measured = pipe.measured_memory[rank].peak.total
        messages = pipe.measured_memory[rank].messages
        dist.barrier()
    row = {
        "rank": rank, "plan": plan.rank_memory[rank], "probe": measured, "rss0": samples[0],
        "params": sum(s.param_bytes for s in plan.stages if rank in s.ranks),
        "messages": messages,
        "warm": warm, "end": samples[-1], "samples": samples, "hwm": hwm(), "times": times,
    }  # fmt: skip
    Path(out, f"{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument(
        "--no-pool",
        action="store_true",
        help="a fresh buffer per message, as before runtime/message_pool.py",
    )
    parser.add_argument(
        "--glibc-default",
        action="store_true",
        help="glibc's moving mmap threshold, as before runtime/host_heap.py",
    )
    parser.add_argument("--json", default="benchmarks/results/runtime_memory.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdcompile-memory-") as tmp:
        mp.spawn(_rank, args=(args, os.path.join(tmp, "store"), tmp), nprocs=args.ranks)
        rows = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(args.ranks)]
    print(f"{args.schedule}, {args.ranks} ranks, MLP({args.width}) x {args.layers}, "
          f"{args.microbatches} microbatches of {args.rows} rows, {args.steps} steps, "
          f"pool {'off' if args.no_pool else 'on'}, "
          f"mmap threshold {'glibc' if args.glibc_default else 'fixed'} (MiB)")  # fmt: skip
    print("rank  plan   probe  messages  RSS0    growth  late  peak growth  beyond plan  "
          "median step")  # fmt: skip
    for r in rows:
        peak = r["hwm"] - r["rss0"]
        beyond = peak - (r["plan"] - r["params"])  # the parameters are in RSS0 already
        print(f"{r['rank']:4d}  {r['plan'] / MIB:5.1f}  {r['probe'] / MIB:5.1f}  "
              f"{r['messages'] / MIB:8.2f}  "
              f"{r['rss0'] / MIB:6.1f}  {(r['end'] - r['rss0']) / MIB:6.1f}  "
              f"{(r['end'] - r['warm']) / MIB:5.1f}  {peak / MIB:6.1f}       {beyond / MIB:6.1f}  "
              f"{sorted(r['times'])[len(r['times']) // 2] * 1e3:8.0f} ms")  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": rows}, indent=1))


if __name__ == "__main__":
    main()
