"""A small CNN on scikit-learn's bundled digits, trained three ways on the same ranks.

    pip install -e ".[examples]"
    torchrun --standalone --nproc_per_node 2 examples/train_digits.py [--seeds 5] [--epochs 12]

Methods, at the same per-update batch size and learning rate:
- `pipedream`: pdcompile.compile(..., schedule="pipedream"), one stage per rank; every
  microbatch is a minibatch with its own update (weight stashing, asynchronous);
- `1f1b`: pdcompile.compile(..., schedule="1f1b"): synchronous, one update per batch;
- `ddp`: torch's DistributedDataParallel, each rank half of every batch.
Validates every 256 samples; prints validation accuracy per epoch, then a table of samples seen
until 95% validation accuracy (median over seeds) and final accuracies; writes
`digits_results.json` and, with matplotlib, `digits_curves.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

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
    """Accuracy after every epoch and the samples seen when validation first reaches 95%."""
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

    curve, seen, reached = [], 0, None
    for epoch in range(epochs):
        for bx, by in batches(x, y, rows, epoch, seed):
            step(bx, by)
            seen += rows
            if seen % EVERY < rows:
                curve.append((seen, accuracy()))
                if reached is None and curve[-1][1] >= TARGET:
                    reached = seen
        if rank == 0:
            print(f"{method:9s} seed {seed} epoch {epoch + 1:2d}: val accuracy "
                  f"{curve[-1][1]:.3f}", flush=True)  # fmt: skip
    return {"curve": curve, "samples_to_target": reached, "final": curve[-1][1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--methods", default="pipedream,1f1b,ddp")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--out", default="digits_results.json")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    init_process_group(rank, world_size, timeout_s=600)
    results = {
        method: [
            run(method, seed, args.epochs, rank, world_size, args.lr, args.momentum)
            for seed in range(args.seeds)
        ]
        for method in args.methods.split(",")
    }
    if rank == 0:
        report(results, args.out)
    dist.destroy_process_group()


def report(results: dict, out: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"digits: samples seen until {TARGET:.0%} validation accuracy")
    for column in ("method", "median samples", "per seed", "final accuracy (median)"):
        table.add_column(column, justify="right")
    summary = {}
    for method, runs in results.items():
        reached = [r["samples_to_target"] for r in runs]
        done = [s for s in reached if s is not None]
        median = statistics.median(done) if len(done) == len(reached) else None
        final = statistics.median(r["final"] for r in runs)
        summary[method] = {"median_samples_to_target": median, "per_seed": reached,
                           "median_final_accuracy": final}  # fmt: skip
        table.add_row(method, str(median), str(reached), f"{final:.3f}")
    Console().print(table)
    if "ddp" in summary and summary["ddp"]["median_samples_to_target"]:
        for method, s in summary.items():
            if method != "ddp" and s["median_samples_to_target"]:
                ratio = s["median_samples_to_target"] / summary["ddp"]["median_samples_to_target"]
                s["ratio_to_ddp"] = ratio
                print(f"{method}: {ratio:.2f}x DDP's samples to {TARGET:.0%}")
    with open(out, "w") as f:
        json.dump({"summary": summary, "runs": results}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    for method, runs in results.items():
        for i, r in enumerate(runs):
            seen, acc = zip(*r["curve"], strict=True)
            plt.plot(seen, acc, label=method if i == 0 else None,
                     color={"pipedream": "C0", "1f1b": "C1", "ddp": "C2"}.get(method))  # fmt: skip
    plt.axhline(TARGET, color="grey", lw=0.5)
    plt.xlabel("samples seen")
    plt.ylabel("validation accuracy")
    plt.legend()
    plt.savefig(out.replace(".json", ".png").replace("results", "curves"), dpi=120)


if __name__ == "__main__":
    main()
