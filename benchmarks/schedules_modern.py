"""The schedules of today's large-model training: the whole test matrix, and their simulated
bubbles against the closed forms.

    python benchmarks/schedules_modern.py [--matrix-only | --bubbles-only] [--ranks 2 4]

1. Matrix: every registered synchronous kind but `1f1b` and `gpipe`, with each chunk count
   `schedule="auto"` tries (today `interleaved-1f1b`, `zb-h1` 1 and 2, `zb-h2`, `zb-v`,
   `dualpipev`, `synth` and whatever else is registered), placed as the kind places them,
   x the MLP, the residual CNN (`zoo.ResNet`, width 8, 16 x 16 images) and the GPT-style
   decoder with tied weights x SGD with momentum and Adam, on 2 and 4 spawned gloo ranks (one
   thread each, M = 2 x ranks), 5 steps each from a fresh model: the largest difference of any
   parameter from single-process gradient accumulation over the same microbatches
   (`tests/test_schedules_modern.py` runs a covering subset; the MLP has too few layers for 8
   stages with parameters, so it skips 2 chunks on 4 ranks).
2. Bubbles (a kind without closed forms: "-"; `synth` with its default orders, not fitted to a
   plan): on p = 8 and 16 ranks, M = 16, 32, 64, the same model per rank (F = I = W = 1 s
   per microbatch of a rank's share, cut in v chunks of 1/v each): simulated bubble and peak
   activations (in microbatches of a rank's share) against the closed forms.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, TESTS)

from pipeline_support import OPTIMIZERS, accumulate_reference  # noqa: E402
from spawn import run_ranks  # noqa: E402
from test_schedules_modern import CASES, comparable, placement, staged  # noqa: E402

import pdcompile  # noqa: E402
from pdcompile import Cluster, Plan, ScheduleError, Stage  # noqa: E402
from pdcompile.runtime.distributed import init_process_group  # noqa: E402
from pdcompile.runtime.executor import DistributedPipeline  # noqa: E402
from pdcompile.scheduling import get_schedule  # noqa: E402

# every registered synchronous kind but 1F1B and GPipe, with each chunk count auto tries
SCHEDULES = [
    (kind, v)
    for kind in pdcompile.schedules()
    if kind not in ("1f1b", "gpipe") and get_schedule(kind).synchronous
    for v in sorted(get_schedule(kind).auto_chunks)
]
STEPS = 5


def _configs(world_size: int) -> list[tuple[str, int, str, str]]:
    return [
        (kind, v, case, opt)
        for kind, v in SCHEDULES
        for case in CASES
        for opt in OPTIMIZERS
        if not (case == "mlp" and world_size * v > 4)  # 4 linear layers: at most 4 stages
    ]


def _train(rank: int, world_size: int, init_file: str, configs: list) -> list[tuple]:
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    out = []
    for kind, v, case, opt in configs:
        _, x, y, loss_fn = CASES[case]()
        start = time.perf_counter()
        pipeline = DistributedPipeline(
            staged(case, kind, world_size, v), rank=rank, schedule=kind,
            num_microbatches=2 * world_size, loss_fn=loss_fn, optimizer=OPTIMIZERS[opt],
            device=device, timeout_s=120,
        )  # fmt: skip
        for _ in range(STEPS):
            pipeline.train_step((x,), y)
        params = {
            n: p.detach().clone()
            for worker in pipeline.workers.values()
            for n, p in worker.module.named_parameters(remove_duplicate=False)
        }
        out.append((params, time.perf_counter() - start))
    dist.destroy_process_group()
    return out


def matrix(console: Console, sizes: list[int]) -> None:
    table = Table(title=f"parameters after {STEPS} steps against gradient accumulation")
    for column in ("ranks", "schedule", "chunks", "case", "optimizer", "max |diff|", "s"):
        table.add_column(column)
    for world_size in sizes:
        configs = _configs(world_size)
        per_rank = run_ranks(_train, world_size, configs, timeout_s=1800)
        for i, (kind, v, case, opt) in enumerate(configs):
            model, x, y, loss_fn = CASES[case]()
            m = 2 * world_size
            ref, _ = accumulate_reference(model, x, y, loss_fn, OPTIMIZERS[opt], m, STEPS)
            expected = dict(ref.named_parameters(remove_duplicate=False))
            trained = {n: t for rank in per_rank for n, t in rank[i][0].items()}
            diff = max(
                float((comparable(n, t) - comparable(n, expected[n].detach())).abs().max())
                for n, t in trained.items()
            )
            seconds = max(rank[i][1] for rank in per_rank)
            table.add_row(str(world_size), kind, str(v), case, opt, f"{diff:.1e}",
                          f"{seconds:.2f}")  # fmt: skip
    console.print(table)


def bubbles(console: Console) -> None:
    table = Table(title="simulated against closed form, F = I = W per rank (1 s)")
    for column in ("p", "M", "schedule", "chunks", "bubble", "closed form", "peak in flight"):
        table.add_column(column)
    for p in (8, 16):
        for m in (16, 32, 64):
            for kind, v in [("1f1b", 1), *SCHEDULES]:
                rules = get_schedule(kind)
                ranks = placement(kind, p, v)
                if not rules.accepts([1] * len(ranks), m) or (v > 1 and m % p):
                    table.add_row(str(p), str(m), kind, str(v), "not accepted", "", "")
                    continue
                forward, act = 1.0 / v, 120 // v
                stages = tuple(
                    Stage(index=i, nodes=(f"n{i}",), replicas=1, ranks=r, forward_s=forward,
                          backward_s=2 * forward, recv_bytes=((i - 1, 1),) if i else (),
                          activation_bytes=act)
                    for i, r in enumerate(ranks)
                )  # fmt: skip
                plan = Plan(stages=stages, cluster=Cluster([(p, 1e30)]))
                sim = pdcompile.simulate(plan, schedule=kind, num_microbatches=m)
                try:
                    closed = f"{rules.bubble(len(ranks), m, forward, 2 * forward, chunks=v):.2%}"
                except ScheduleError:  # a kind without closed forms
                    closed = "-"
                held = max(sim.peak_memory) / 120
                table.add_row(str(p), str(m), kind, str(v), f"{sim.bubble_fraction[0]:.2%}",
                              closed, f"{held:g}")  # fmt: skip
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrix-only", action="store_true")
    parser.add_argument("--bubbles-only", action="store_true")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    torch.set_num_threads(1)
    console = Console()
    if not args.matrix_only:
        bubbles(console)
    if not args.bubbles_only:
        matrix(console, args.ranks)


if __name__ == "__main__":
    main()
