"""The closed loop on 2 gloo ranks: a job started on a deliberately bad plan moves to a better one.

    python benchmarks/replan.py [--steps 12] [--after 4] [--json out.json]

A chain of 6 Linear(1024) with ReLU between, batch 64 in 4 microbatches, SGD with momentum,
`1f1b`, on 2 spawned gloo ranks (one thread each). Rank 0 profiles the model (`analyze`, cache
off), then the profile is made wrong: the first Linear's times are multiplied by 10, so the plan
puts it nearly alone on rank 0 and everything else on rank 1. `compile(..., costs=wrong,
replan=Replan(after_steps=A))` measures the real stage times over the first A steps, re-plans
and moves. The table gives, per rank 0's clock: the median step time before the move (steps 1 to
A - 1), after it (the steps after the move's), samples per second before and after, the seconds
the move took (checkpoint, codegen, new executor, load), the plans' stage shapes and the
predicted step times of both on the measured costs. The cluster is this machine's, measured
first (`runtime.calibration.calibrate`: link latency and bandwidth, the runtime's costs). Wall
times on a shared 2-core machine are noisy: compare the ratio, not the milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile.runtime.calibration import calibrate
from pdcompile.runtime.distributed import init_process_group

WIDTH, LAYERS, BATCH, MICROBATCHES = 1024, 6, 64, 4
WRONG = "_0"  # the first Linear


def make_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1]), torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)


def wrong_costs(path: str) -> None:
    """Profile the model and write its costs with the first Linear 10x too slow."""
    model, x, _ = make_case()
    example = x[: BATCH // MICROBATCHES]
    costs = pdcompile.analyze(pdcompile.trace(model, (example,)), (example,), cache=False,
                              progress=False)  # fmt: skip
    for name in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s"):
        costs.graph.nodes[WRONG][name] *= 10
    costs.save(path)


def _rank(rank: int, world: int, init_file: str, costs: str, steps: int, after: int, out: str):
    torch.set_num_threads(1)
    init_process_group(rank, world, init_file=init_file, timeout_s=120)
    model, x, y = make_case()
    sgd = lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)  # noqa: E731
    cluster = calibrate(rank, torch.device("cpu"), sgd).cluster(world)  # this machine's links
    pipe = pdcompile.compile(
        model, (x[: BATCH // MICROBATCHES],), loss_fn=F.mse_loss, cluster=cluster,
        optimizer=sgd, costs=costs,
        num_microbatches=MICROBATCHES, replan=pdcompile.Replan(after_steps=after),
    )  # fmt: skip
    first = [len(s.nodes) for s in pipe.plan.stages]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        pipe.train_step(x, y)
        times.append(time.perf_counter() - start)
    if rank == 0:
        replanner = pipe.replanner
        decision = replanner.decision
        moved = replanner.moved_at
        result = {
            "first": first, "last": [len(s.nodes) for s in pipe.plan.stages],
            "moved_at": moved, "move_s": replanner.move_s, "times": times,
            "running_s": decision.running.step_time, "new_s": decision.new.step_time,
            "reason": decision.reason, "decision": decision.describe(),
        }  # fmt: skip
        with open(out, "w") as f:
            json.dump(result, f)


def summarize(r: dict) -> dict:
    moved, times = r["moved_at"], r["times"]
    before = times[1 : (moved or len(times)) - 1]  # the move's step pays the move
    after = times[moved:] if moved else []
    out = {"before_s": statistics.median(before), "after_s": statistics.median(after) if after
           else None}  # fmt: skip
    out["speedup"] = out["before_s"] / out["after_s"] if after else None
    return {**r, **out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--after", type=int, default=4)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        costs, out = os.path.join(tmp, "costs.json"), os.path.join(tmp, "out.json")
        wrong_costs(costs)
        start = time.perf_counter()
        ranks = (2, os.path.join(tmp, "store"), costs, args.steps, args.after, out)
        mp.start_processes(_rank, args=ranks, nprocs=2, start_method="spawn")
        wall = time.perf_counter() - start
        with open(out) as f:
            r = summarize(json.load(f))
    table = Table(
        title=f"replan=Replan(after_steps={args.after}) on 2 gloo ranks, {args.steps} steps of "
        f"{LAYERS} Linear({WIDTH}), batch {BATCH} ({wall:.0f} s in all)"
    )
    for column in ("", "stages (nodes)", "median step", "samples/s", "predicted step"):
        table.add_column(column)
    table.add_row("before the move", str(r["first"]), f"{r['before_s'] * 1e3:.1f} ms",
                  f"{BATCH / r['before_s']:.0f}", f"{r['running_s'] * 1e3:.1f} ms")  # fmt: skip
    if r["after_s"]:
        table.add_row("after the move", str(r["last"]), f"{r['after_s'] * 1e3:.1f} ms",
                      f"{BATCH / r['after_s']:.0f}", f"{r['new_s'] * 1e3:.1f} ms")  # fmt: skip
    Console(width=140).print(table)
    print(r["decision"])
    if r["moved_at"]:
        print(f"moved after step {r['moved_at']} in {r['move_s']:.2f} s; measured speed-up "
              f"{r['speedup']:.2f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
