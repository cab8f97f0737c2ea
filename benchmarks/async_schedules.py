"""`pipedream` at its steady state: against its ideal and against `1f1b`, on 2 gloo CPU ranks.

    python benchmarks/async_schedules.py [--steps 6] [--rounds 5] [--profile] [--json out.json]

Three models on the same 2-stage split (the `blocks` solver's), one gloo thread a rank:

- `mlp`, `gpt`: `benchmarks/cases.py` (MLP 256-1024x3-10 batch 64, GPT 4 layers width 128), 8
  microbatches;
- `big-mlp`: 6 Linear(2048, 2048) with ReLU between, 128 rows in 4 microbatches, MSE loss:
  large parameters (16 MiB a layer), where per-microbatch updates and weight copies cost most.

All train with SGD(lr=0.01, momentum=0.9). Per model, `pipedream` and `1f1b` alternate round by
round in the same processes, each for `--steps` steps a round (pipedream flushed at the end of a
round): the median over rounds of the per-round ratio of their rows per second. Then one more
`pipedream` run with the action timeline recorded: steady-state throughput (minibatches per
second over the second half) against the ideal, 1 / the slowest stage's forward + backward per
minibatch from the same timeline, and each rank's milliseconds per minibatch by kind of action.
`--profile` prints each rank's cProfile of that run (top 15 by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from cases import CASES, keep_freed_memory

import pdcompile
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline


def big_mlp_case():
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(2048, 2048)]
    for _ in range(5):
        layers += [nn.ReLU(), nn.Linear(2048, 2048)]
    return nn.Sequential(*layers), torch.randn(128, 2048), torch.randn(128, 2048), F.mse_loss


MODELS = {  # name: (case, microbatches)
    "mlp": (CASES["mlp"], 8),
    "gpt": (CASES["gpt"], 8),
    "big-mlp": (big_mlp_case, 4),
}


def two_stage_program(model: nn.Module, x: torch.Tensor) -> pdcompile.StagedProgram:
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False)
    return pdcompile.codegen(gm, pdcompile.plan(costs, pdcompile.Cluster.parse("2"),
                                                solver="blocks"))  # fmt: skip


def _pipeline(name: str, schedule: str, rank: int, device: torch.device) -> tuple:
    case, m = MODELS[name]
    model, x, y, loss_fn = case()
    sgd = lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)  # noqa: E731
    pipeline = DistributedPipeline(
        two_stage_program(model, x), rank=rank, schedule=schedule, num_microbatches=m,
        loss_fn=loss_fn, optimizer=sgd, device=device, timeout_s=120,
    )  # fmt: skip
    return pipeline, x, y


def _rows_per_s(pipeline, x, y, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        pipeline.train_step((x,), y)
    pipeline.flush()
    dist.barrier()
    return steps * x.shape[0] / (time.perf_counter() - start)


def _steady(pipeline, x, y, steps: int, profile: bool) -> dict:
    pipeline.worker.timeline = []
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    for _ in range(steps):
        pipeline.train_step((x,), y)
    pipeline.flush()
    if profiler:
        profiler.disable()
    events = pipeline.worker.timeline
    pipeline.worker.timeline = None
    half = len(events) // 2
    compute = [e for e in events[half:] if e.kind in ("F", "B")]
    minibatches = sum(1 for e in compute if e.kind == "B")
    span = events[-1].end - events[half].start
    per_kind: dict[str, float] = {}
    for e in events[half:]:
        per_kind[e.kind] = per_kind.get(e.kind, 0.0) + e.duration
    out = {
        "throughput": minibatches / span,
        "compute_per_minibatch": sum(e.duration for e in compute) / minibatches,
        "ms_per_minibatch": {k: v / minibatches * 1e3 for k, v in per_kind.items()},
    }
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
        out["profile"] = text.getvalue()
    return out


def _rank(rank, world_size, init_file, names, steps, rounds, profile, out) -> None:
    torch.set_num_threads(1)
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    results = {}
    for name in names:
        runs = {s: _pipeline(name, s, rank, device) for s in ("pipedream", "1f1b")}
        for pipeline, x, y in runs.values():  # warm up
            _rows_per_s(pipeline, x, y, 1)
        speeds: dict[str, list[float]] = {"pipedream": [], "1f1b": []}
        for _ in range(rounds):
            for schedule, (pipeline, x, y) in runs.items():
                speeds[schedule].append(_rows_per_s(pipeline, x, y, steps))
        pipeline, x, y = runs["pipedream"]
        results[name] = {"speeds": speeds, "steady": _steady(pipeline, x, y, 2 * steps, profile)}
        for pipeline, _, _ in runs.values():
            pipeline.close()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), action="append")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    keep_freed_memory(False)
    names = args.model or list(MODELS)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), names, args.steps, args.rounds,
                              args.profile, out), nprocs=2, join=True)  # fmt: skip
        with open(out) as f:
            per_rank = json.load(f)
    summary = {}
    for name in names:
        speeds = per_rank[0][name]["speeds"]
        ratio = statistics.median(
            a / b for a, b in zip(speeds["pipedream"], speeds["1f1b"], strict=True)
        )
        steady = [per_rank[r][name]["steady"] for r in range(2)]
        ideal = 1 / max(s["compute_per_minibatch"] for s in steady)
        achieved = min(s["throughput"] for s in steady)
        summary[name] = {
            "pipedream_rows_per_s": statistics.median(speeds["pipedream"]),
            "1f1b_rows_per_s": statistics.median(speeds["1f1b"]),
            "pipedream_over_1f1b": ratio, "steady_throughput": achieved, "ideal": ideal,
            "fraction_of_ideal": achieved / ideal,
        }  # fmt: skip
        print(
            f"{name}: pipedream {summary[name]['pipedream_rows_per_s']:.0f} rows/s, 1f1b "
            f"{summary[name]['1f1b_rows_per_s']:.0f} (paired ratio {ratio:.2f}x); steady "
            f"state {achieved:.1f} minibatches/s, ideal {ideal:.1f}: {achieved / ideal:.0%}"
        )
        for rank in range(2):
            kinds = steady[rank]["ms_per_minibatch"]
            print(
                f"  rank {rank} ms per minibatch: "
                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
            )
            if args.profile:
                print(steady[rank]["profile"])
    print(f"load {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
