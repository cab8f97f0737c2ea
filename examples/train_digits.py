"""A small CNN on scikit-learn's bundled digits, trained three ways on the same ranks.

    pip install -e ".[examples]"
    torchrun --standalone --nproc_per_node 2 examples/train_digits.py [--seeds 3] [--epochs 10]
        [--out out/digits] [--verbose]

Methods, at the same per-update batch size and learning rate:
- `pipedream`: pdcompile.compile(..., schedule="pipedream"), one stage per rank; every
  microbatch is a minibatch with its own update (weight stashing, asynchronous);
- `1f1b`: pdcompile.compile(..., schedule="1f1b"): synchronous, one update per batch;
- `ddp`: torch's DistributedDataParallel, each rank half of every batch.
Validates every 256 samples. Prints a table of the samples seen until 95% validation accuracy
(median over seeds) and the final accuracies, then, with `--verbose`, the validation accuracy of
every run after every epoch. Writes `results.json` and, with matplotlib, `curves.png` into
`--out` (default `out/digits/`, which git ignores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile.runtime.distributed import init_process_group

UPDATE_BATCH = 32  # rows per optimizer update, for every method
MICROBATCHES = 4
EVERY = 256  # samples between validations
TARGET = 0.95
EPOCH_ROWS = 1437  # the training split: 80% of the 1797 images


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 2 * 2, 128), nn.ReLU(),
                                  nn.Linear(128, 10))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # [B, 1, 8, 8] -> [B, 10]


def digits(seed: int) -> tuple[torch.Tensor, ...]:
    """Train and validation splits (80/20, shuffled by `seed`), images scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, val = order[:cut], order[cut:]
    return x[train], y[train], x[val], y[val]


def batches(x: torch.Tensor, y: torch.Tensor, rows: int, epoch: int, seed: int):
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    for start in range(0, len(x) - rows + 1, rows):
        index = order[start : start + rows]
        yield x[index], y[index]


def run(
    method: str, seed: int, epochs: int, rank: int, world_size: int, lr: float, momentum: float
) -> dict:
    """Validation accuracy every `EVERY` samples and after every epoch, the samples seen when
    validation first reaches 95%, and the run's seconds (compile included)."""
    start = time.perf_counter()
    x, y, vx, vy = digits(seed)
    torch.manual_seed(seed)
    model = DigitsCNN().train()
    sgd = lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)  # noqa: E731
    if method == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = sgd(list(ddp.parameters()))
        rows, share = UPDATE_BATCH, UPDATE_BATCH // world_size

        def step(bx, by):
            mine = slice(rank * share, (rank + 1) * share)
            loss = F.cross_entropy(ddp(bx[mine]), by[mine])
            opt.zero_grad()
            loss.backward()
            opt.step()

        def accuracy() -> float:
            with torch.no_grad():
                model.eval()
                correct = (model(vx).argmax(1) == vy).float().mean().item()
                model.train()
            return correct
    else:
        pipe = pdcompile.compile(
            model, (x[:UPDATE_BATCH],), loss_fn=F.cross_entropy, optimizer=sgd,
            schedule=method, num_microbatches=MICROBATCHES, solver="uniform", profile=False,
        )  # fmt: skip
        # pipedream updates once per microbatch: give it MICROBATCHES updates' rows per step
        rows = UPDATE_BATCH * (MICROBATCHES if method == "pipedream" else 1)

        def step(bx, by):
            pipe.train_step(bx, by)

        def accuracy() -> float:
            out = pipe.eval_step(vx)
            correct = torch.tensor(
                [(out.argmax(1) == vy).float().mean().item() if out is not None else -1.0]
            )
            dist.all_reduce(correct, op=dist.ReduceOp.MAX)  # from the last stage to every rank
            return correct.item()

    curve, epochs_end, seen, reached = [], [], 0, None
    for epoch in range(epochs):
        for bx, by in batches(x, y, rows, epoch, seed):
            step(bx, by)
            seen += rows
            if seen % EVERY < rows:
                curve.append((seen, accuracy()))
                if reached is None and curve[-1][1] >= TARGET:
                    reached = seen
        epochs_end.append(curve[-1][1])
    if method != "ddp":
        pipe.close()
    return {"curve": curve, "epochs": epochs_end, "samples_to_target": reached,
            "final": curve[-1][1], "seconds": time.perf_counter() - start}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--methods", default="pipedream,1f1b,ddp")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--out", default="out/digits", help="folder of results.json, curves.png")
    parser.add_argument("--verbose", action="store_true", help="accuracy after every epoch")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    init_process_group(rank, world_size, timeout_s=600)
    start = time.perf_counter()
    methods = args.methods.split(",")
    results: dict[str, list[dict]] = {method: [] for method in methods}
    with _progress(rank, len(methods) * args.seeds) as advance:
        for method in methods:
            for seed in range(args.seeds):
                advance(f"{method}, seed {seed}")
                results[method].append(
                    run(method, seed, args.epochs, rank, world_size, args.lr, args.momentum)
                )
    if rank == 0:
        report(results, Path(args.out), args.verbose, time.perf_counter() - start)
    dist.destroy_process_group()


@contextlib.contextmanager
def _progress(rank: int, total: int):
    """On rank 0 at a terminal, a bar over the runs, gone when they end; elsewhere nothing."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (TextColumn("training {task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, transient=True, disable=rank != 0) as bar:
        task = bar.add_task("", total=total)
        started = False

        def advance(what: str) -> None:
            nonlocal started
            bar.update(task, description=what, advance=1 if started else 0)
            started = True

        yield advance


def report(results: dict, out: Path, verbose: bool, seconds: float) -> None:
    """The table first; with `verbose`, every run's accuracy after every epoch; then the files."""
    from rich.console import Console
    from rich.table import Table

    first = next(iter(results.values()))
    seeds, epochs = len(first), len(first[0]["epochs"])
    table = Table(title=f"digits: samples seen until {TARGET:.0%} validation accuracy\n"
                  f"({seeds} seeds, {epochs} epochs of {EPOCH_ROWS} images)")  # fmt: skip
    for column in ("method", "median samples", "per seed", "final accuracy (median)"):
        table.add_column(column, justify="right")
    summary = {}
    for method, runs in results.items():
        reached = [r["samples_to_target"] for r in runs]
        # a seed that never reached the target counts as slower than every other
        median = statistics.median(math.inf if s is None else s for s in reached)
        median = None if math.isinf(median) else median
        final = statistics.median(r["final"] for r in runs)
        summary[method] = {"median_samples_to_target": median, "per_seed": reached,
                           "median_final_accuracy": final,
                           "seconds": [round(r["seconds"], 2) for r in runs]}  # fmt: skip
        shown = "not reached" if median is None else f"{median:g}"
        table.add_row(method, shown, str(reached), f"{final:.3f}")
    console = Console()
    console.print(table)
    if "ddp" in summary and summary["ddp"]["median_samples_to_target"]:
        for method, s in summary.items():
            if method != "ddp" and s["median_samples_to_target"]:
                ratio = s["median_samples_to_target"] / summary["ddp"]["median_samples_to_target"]
                s["ratio_to_ddp"] = ratio
                print(f"{method}: {ratio:.2f}x DDP's samples to {TARGET:.0%}")
    print(f"{sum(len(runs) for runs in results.values())} runs in {seconds:.0f} s")
    if verbose:
        detail = Table(title="validation accuracy after each epoch")
        detail.add_column("method, seed")
        for epoch in range(epochs):
            detail.add_column(str(epoch + 1), justify="right")
        for method, runs in results.items():
            for seed, r in enumerate(runs):
                detail.add_row(f"{method} {seed}", *(f"{a:.2f}" for a in r["epochs"]))
        console.print(detail)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.json", "w") as f:
        json.dump({"summary": summary, "runs": results}, f, indent=1)
    written = [out / "results.json"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None:
        colors = {"pipedream": "C0", "1f1b": "C1", "ddp": "C2"}
        for method, runs in results.items():
            for i, r in enumerate(runs):
                seen, acc = zip(*r["curve"], strict=True)
                plt.plot(seen, acc, label=method if i == 0 else None, color=colors.get(method))
        plt.axhline(TARGET, color="grey", lw=0.5)
        plt.xlabel("samples seen")
        plt.ylabel("validation accuracy")
        plt.legend()
        plt.savefig(out / "curves.png", dpi=120)
        written.append(out / "curves.png")
    print("wrote " + ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
