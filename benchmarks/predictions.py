"""`compile()`'s prediction against the run: `explain()`'s predicted step time and the measured one.

    python benchmarks/predictions.py [--steps 8] [--rounds 3] [--json out.json] [--default-malloc]

Three models on 2 spawned gloo ranks, one thread each: the MLP and the GPT-style decoder of
benchmarks/cases.py, and a heavy-head token model (an embedding, 2 Linear(256) layers and a
16k-vocabulary head under cross-entropy: the loss is the heaviest single operation). Each round
the ranks measure this machine's links and runtime costs (`runtime.calibration.calibrate`), then
for `1f1b` and `gpipe` in turn (alternating from round to round) run `pdcompile.compile` with
that cluster, the example microbatch and its targets (so the loss and the optimizer step are
priced), 8 microbatches, profiling on rank 0 as compile does (while rank 1 trains the model,
`runtime/profile_load.py`; once per model and round, into a cache of the round's own, so each
round is predicted from a profile of its own), and time `--steps` train steps.
The table gives per (model, schedule) the predicted step time (`pipe.plan.step_time`, the plan
re-scored at the rows run: what `explain()` prints), the median measured step time over rounds
(each round's median over its steps after the first), the ratio predicted / measured, and the
spread of the per-round ratios (min-max). This machine's two cores change speed under other jobs:
the spread is part of the result. The ranks run with glibc's malloc keeping freed memory
(`cases.KEEP_FREED_MEMORY`, as benchmarks/simulator.py and runtime.py do; `--default-malloc`
for glibc's defaults, under which a step's times depend on whether its tensors land on pages
just given back to the system: docs/runtime.md).
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
from cases import CASES, keep_freed_memory
from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile.runtime.calibration import calibrate
from pdcompile.runtime.distributed import init_process_group

SCHEDULES = ("1f1b", "gpipe")
MICROBATCHES = 8


class HeavyHead(nn.Module):
    """Tokens -> embedding -> 2 Linear(256) with GELU -> a 16k-vocabulary head."""

    def __init__(self, vocab: int = 16384, width: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def heavy_head_case():
    torch.manual_seed(0)
    x, y = torch.randint(0, 16384, (32, 16)), torch.randint(0, 16384, (32, 16))
    return HeavyHead().train(), x, y, lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())


MODELS = {**CASES, "heavy-head": heavy_head_case}


def _rank(rank: int, world: int, init_file: str, steps: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    init_process_group(rank, world, init_file=init_file, timeout_s=300)
    sgd = lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)  # noqa: E731
    results = []
    for round_ in range(rounds):
        # a profile cache of the round's own: each round's prediction comes from a profile taken
        # in it (this machine's speed drifts by tens of percent within minutes)
        os.environ["PDCOMPILE_CACHE_DIR"] = os.path.join(os.path.dirname(init_file), str(round_))
        cluster = calibrate(rank, torch.device("cpu"), sgd).cluster(world)
        order = SCHEDULES if round_ % 2 == 0 else SCHEDULES[::-1]
        for name, make in MODELS.items():
            for schedule in order:
                model, x, y, loss_fn = make()
                rows = len(x) // MICROBATCHES
                pipe = pdcompile.compile(
                    model, (x[:rows],), example_targets=y[:rows], loss_fn=loss_fn,
                    optimizer=sgd, cluster=cluster, schedule=schedule,
                    num_microbatches=MICROBATCHES,
                )  # fmt: skip
                times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    pipe.train_step(x, y)
                    times.append(time.perf_counter() - start)
                pipe.close()  # its process groups: 48 pipelines' threads ran beside the last
                results.append({
                    "round": round_, "model": name, "schedule": schedule,
                    "predicted_s": pipe.plan.step_time,
                    "measured_s": statistics.median(times[1:]),
                    "stages": [len(s.nodes) for s in pipe.plan.stages],
                })  # fmt: skip
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def summarize(results: list[dict]) -> list[dict]:
    rows = []
    for name in MODELS:
        for schedule in SCHEDULES:
            mine = [r for r in results if (r["model"], r["schedule"]) == (name, schedule)]
            ratios = [r["predicted_s"] / r["measured_s"] for r in mine]
            rows.append({
                "model": name, "schedule": schedule,
                "predicted_s": statistics.median(r["predicted_s"] for r in mine),
                "measured_s": statistics.median(r["measured_s"] for r in mine),
                "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
                "stages": mine[-1]["stages"],
            })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the rounds and the summary here")
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="glibc's malloc defaults (its thresholds move with the heap)",
    )
    args = parser.parse_args()
    keep_freed_memory(args.default_malloc)
    malloc = os.environ.get("GLIBC_TUNABLES", "default")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        start = time.perf_counter()
        ranks = (2, os.path.join(tmp, "store"), args.steps, args.rounds, out)
        mp.start_processes(_rank, args=ranks, nprocs=2, start_method="spawn")
        wall = time.perf_counter() - start
        with open(out) as f:
            results = json.load(f)
    rows = summarize(results)
    table = Table(
        title=f"compile() on 2 gloo ranks: predicted (explain) vs measured step, {args.rounds} "
        f"rounds x {args.steps} steps, {MICROBATCHES} microbatches ({wall:.0f} s in all), "
        f"malloc: {malloc}"
    )
    for column in ("model", "schedule", "stages", "predicted", "measured", "ratio", "range"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["model"], r["schedule"], str(r["stages"]),
                      f"{r['predicted_s'] * 1e3:.1f} ms", f"{r['measured_s'] * 1e3:.1f} ms",
                      f"{r['ratio']:.2f}", f"{r['low']:.2f}-{r['high']:.2f}")  # fmt: skip
    Console(width=140).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"malloc": malloc, "rounds": results, "summary": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
