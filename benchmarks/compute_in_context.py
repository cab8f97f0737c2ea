"""How fast one stage computes in different contexts on this machine: the evidence behind the
simulator's remaining error on the GPT (docs/simulator.md, "What the machine does").

    python benchmarks/compute_in_context.py [--model gpt|mlp] [--seconds 4] [--reps 3]
                                            [--json FILE]

1. One process, one thread: stage 0's forward (no autograd) timed back to back for `--seconds`
   while a second process leaves the other core idle, keeps it busy, or alternates 2 ms busy
   and 2 ms asleep. Percentiles and the tallest bins of a histogram (0.2 ms wide) show whether
   the core runs at one speed.
2. Two gloo ranks, one thread each: each rank's stage forward and backward (medians of 55 after
   5 untimed) alone (the other rank waits in a barrier), with both ranks in loops at once, with
   0.5 ms of spinning, 0.5 ms of sleep or a 32 KiB message exchange with the other rank before
   each pass, and in the `pipedream` pipeline (its recorded F and B actions over 5 steps), in
   turn within each of `--reps` repetitions.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cases import CASES, keep_freed_memory
from rich.console import Console
from rich.table import Table
from simulator import MICROBATCHES, optimizer, two_stage_program

from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline

PAUSE_S = 5e-4
CONTEXTS = ("alone", "both", "spin", "sleep", "exchange", "pipeline")
Pause = Callable[[], None] | None  # run before each pass (and between forward and backward)


# -- 1. one core's speed ---------------------------------------------------------------------


def _other_core(mode: str, stop) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < 0.002:
            pass
        if mode == "toggling":
            time.sleep(0.002)


def core_speed(model_name: str, seconds: float) -> dict[str, dict]:
    """Forward times (ms) of stage 0 with the other core idle, busy and toggling."""
    torch.set_num_threads(1)
    model, x, _, _ = CASES[model_name]()
    stage, micro = two_stage_program(model, x).stages[0], x[: x.shape[0] // MICROBATCHES]
    rows = {}
    for mode in ("idle", "busy", "toggling"):
        stop = multiprocessing.Event()
        other = None
        if mode != "idle":
            other = multiprocessing.Process(target=_other_core, args=(mode, stop))
            other.start()
            time.sleep(0.1)
        times, end = [], time.perf_counter() + seconds
        with torch.no_grad():
            while time.perf_counter() < end:
                start = time.perf_counter()
                stage(micro)
                times.append((time.perf_counter() - start) * 1e3)
        stop.set()
        if other:
            other.join()
        times.sort()
        bins = Counter(round(t * 5) / 5 for t in times)
        rows[mode] = {
            "n": len(times),
            "p10": times[len(times) // 10], "p50": times[len(times) // 2],
            "p90": times[9 * len(times) // 10],
            "bins": sorted(bins.most_common(4)),
        }  # fmt: skip
    return rows


# -- 2. a stage in context -------------------------------------------------------------------


def _loop(train: Callable[[Pause], tuple[float, float]], before: Pause) -> tuple[float, float]:
    """Medians (ms) of 55 forwards and backwards after 5, `before` run ahead of each."""
    times = []
    for _ in range(60):
        if before:
            before()
        times.append(train(before))
    forward, backward = zip(*times[5:], strict=True)
    return statistics.median(forward) * 1e3, statistics.median(backward) * 1e3


def _stage_pass(program, rank: int, x, y, loss_fn) -> Callable:
    """One timed forward and backward of a copy of this rank's stage on one microbatch, with
    `before` run between them too."""
    stage = copy.deepcopy(program.stages[rank])
    micro, target = x[: x.shape[0] // MICROBATCHES], y[: x.shape[0] // MICROBATCHES]
    inputs = {k: v.detach() for k, v in program.stages[0](micro).items()}

    def train(before: Pause) -> tuple[float, float]:
        start = time.perf_counter()
        if rank == 0:
            outputs = [v for v in stage(micro).values() if v.requires_grad]
        else:
            args = {k: v.requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
            outputs = [loss_fn(stage(**args), target)]
        forward = time.perf_counter() - start
        if before:
            before()
        start = time.perf_counter()
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        return forward, time.perf_counter() - start

    return train


def _rank(rank: int, init_file: str, model_name: str, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    device = init_process_group(rank, 2, init_file=init_file, timeout_s=300)
    model, x, y, loss_fn = CASES[model_name]()
    program = two_stage_program(model, x)
    pipeline = DistributedPipeline(
        two_stage_program(model, x), rank=rank, schedule="pipedream",
        num_microbatches=MICROBATCHES, loss_fn=loss_fn, device=device, optimizer=optimizer,
    )  # fmt: skip
    for _ in range(3):
        pipeline.train_step((x,), y)
    train = _stage_pass(program, rank, x, y, loss_fn)
    outgoing, incoming = torch.ones(8192), torch.empty(8192)

    def spin() -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < PAUSE_S:
            pass

    def exchange() -> None:
        for work in (dist.isend(outgoing, 1 - rank), dist.irecv(incoming, 1 - rank)):
            work.wait()

    pauses = {"both": None, "spin": spin, "sleep": lambda: time.sleep(PAUSE_S),
              "exchange": exchange}  # fmt: skip
    results: dict[str, list] = {context: [] for context in CONTEXTS}
    for _ in range(reps):
        for context, before in pauses.items():
            dist.barrier()
            results[context].append(_loop(train, before))
        pipeline.worker.timeline = []
        dist.barrier()
        for _ in range(5):
            pipeline.train_step((x,), y)
        events, pipeline.worker.timeline = pipeline.worker.timeline, None
        results["pipeline"].append(tuple(
            statistics.median(e.duration for e in events if e.kind == kind) * 1e3
            for kind in ("F", "B")
        ))  # fmt: skip
        for turn in (0, 1):
            dist.barrier()
            if rank == turn:
                results["alone"].append(_loop(train, None))
    pipeline.flush()
    both: list = [None, None]
    dist.all_gather_object(both, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(both, f)
    dist.barrier()
    dist.destroy_process_group()


def stage_in_context(model_name: str, reps: int) -> list[dict]:
    keep_freed_memory(False)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), model_name, reps, out), nprocs=2)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(CASES), default="gpt")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    console = Console(width=150)
    speed = core_speed(args.model, args.seconds)
    table = Table(title=f"{args.model} stage 0 forward, one process, back to back (ms)")
    for column in ("other core", "forwards", "p10", "p50", "p90", "tallest bins (ms: count)"):
        table.add_column(column, justify="right")
    for mode, row in speed.items():
        table.add_row(mode, str(row["n"]), *(f"{row[p]:.2f}" for p in ("p10", "p50", "p90")),
                      "  ".join(f"{t:.1f}: {n}" for t, n in row["bins"]))  # fmt: skip
    console.print(table)
    ranks = stage_in_context(args.model, args.reps)
    table = Table(title=f"{args.model} stage forward / backward per context, 2 gloo ranks (ms)")
    for column in ("rank", "rep", *CONTEXTS):
        table.add_column(column, justify="right")
    for rank, results in enumerate(ranks):
        for rep in range(args.reps):
            table.add_row(str(rank), str(rep), *(
                "{:.2f} / {:.2f}".format(*results[c][rep]) for c in CONTEXTS
            ))  # fmt: skip
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"core_speed": speed, "stage_in_context": ranks}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
