"""A character-level GPT with tied embeddings on Python's own standard library sources, trained
three ways on the same ranks.

    torchrun --standalone --nproc_per_node 2 examples/train_chargpt.py [--updates 300]

Methods, with the same per-update batch size and optimiser: AdamW with betas (0, 0.95) (no
momentum: momentum and a one-update-stale gradient together oscillate, see docs/compile.md), lr
1e-3 warmed up over 100 updates, then cosine-decayed to a tenth by the last update:
- `pipedream`: pdcompile.compile(..., schedule="pipedream"), one stage per rank, an update per
  microbatch (weight stashing, asynchronous);
- `1f1b`: pdcompile.compile(..., schedule="1f1b"), synchronous;
- `ddp`: torch's DistributedDataParallel, each rank half of every batch.
Prints validation loss against samples seen and tokens per second, then a comparison table;
writes `chargpt_results.json` and, with matplotlib, `chargpt_curves.png`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

import pdcompile
from pdcompile import zoo
from pdcompile.runtime.distributed import init_process_group

CONTEXT = 64
UPDATE_BATCH = 32  # sequences per optimizer update, for every method
MICROBATCHES = 4
EVERY = 1024  # sequences between validations
BETAS = (0.0, 0.95)
WARMUP = 100  # updates


def corpus() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Train and validation token streams from a fixed list of standard-library files."""
    root = Path(os.__file__).parent
    names = ["argparse.py", "functools.py", "collections/__init__.py", "dataclasses.py",
             "pathlib.py", "inspect.py", "typing.py", "json/decoder.py"]  # fmt: skip
    text = "\n".join((root / n).read_text(encoding="utf-8") for n in names if (root / n).exists())
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:], len(chars)


def windows(stream: torch.Tensor, rows: int, generator: torch.Generator):
    starts = torch.randint(0, len(stream) - CONTEXT - 1, (rows,), generator=generator)
    x = torch.stack([stream[s : s + CONTEXT] for s in starts])
    y = torch.stack([stream[s + 1 : s + CONTEXT + 1] for s in starts])
    return x, y


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lr_schedule(updates: int) -> Callable[[torch.optim.Optimizer], LambdaLR]:
    """Linear warm-up over WARMUP updates, then cosine decay to a tenth at `updates`."""

    def factor(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        done = min(1.0, (step - WARMUP) / max(1, updates - WARMUP))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))

    return lambda optimizer: LambdaLR(optimizer, factor)


def run(method: str, updates: int, rank: int, world_size: int, lr: float) -> dict:
    train, val, vocab = corpus()
    vx, vy = windows(val, 128, torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    cfg = zoo.GPTConfig(vocab_size=vocab, block_size=CONTEXT, n_layer=4, n_head=4, n_embd=128,
                        dropout=0.0)  # fmt: skip
    model = zoo.GPT(cfg).train()
    adamw = lambda params: torch.optim.AdamW(params, lr=lr, betas=BETAS)  # noqa: E731
    total = -(-updates * UPDATE_BATCH // EVERY) * EVERY  # sequences: whole validation intervals
    schedule = lr_schedule(total // UPDATE_BATCH)
    if method == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = adamw(list(ddp.parameters()))
        scheduler = schedule(opt)
        rows, share = UPDATE_BATCH, UPDATE_BATCH // world_size

        def step(bx, by):
            mine = slice(rank * share, (rank + 1) * share)
            loss = lm_loss(ddp(bx[mine]), by[mine])
            opt.zero_grad()
            loss.backward()
            opt.step()
            scheduler.step()

        def validation() -> float:
            with torch.no_grad():
                return float(lm_loss(model(vx), vy))
    else:
        pipe = pdcompile.compile(
            model, (vx[:UPDATE_BATCH],), loss_fn=lm_loss, optimizer=adamw, schedule=method,
            num_microbatches=MICROBATCHES, solver="uniform", profile=False, lr_scheduler=schedule,
        )  # fmt: skip
        rows = UPDATE_BATCH * (MICROBATCHES if method == "pipedream" else 1)

        def step(bx, by):
            pipe.train_step(bx, by)

        def validation() -> float:
            out = pipe.eval_step(vx)
            loss = torch.tensor([float(lm_loss(out, vy)) if out is not None else float("inf")])
            dist.all_reduce(loss, op=dist.ReduceOp.MIN)  # from the last stage to every rank
            return loss.item()

    generator = torch.Generator().manual_seed(2)
    curve, seen, busy = [], 0, 0.0
    while seen < total:
        bx, by = windows(train, rows, generator)
        start = time.perf_counter()
        step(bx, by)
        busy += time.perf_counter() - start
        seen += rows
        if seen % EVERY < rows:
            curve.append((seen, validation()))
            if rank == 0:
                print(f"{method:9s} {seen:6d} sequences: validation loss {curve[-1][1]:.3f}, "
                      f"{seen * CONTEXT / busy:,.0f} tokens/s", flush=True)  # fmt: skip
    return {"curve": curve, "final": curve[-1][1], "tokens_per_s": seen * CONTEXT / busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--methods", default="pipedream,1f1b,ddp")
    parser.add_argument("--out", default="chargpt_results.json")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    init_process_group(rank, world_size, timeout_s=600)
    results = {m: run(m, args.updates, rank, world_size, args.lr) for m in args.methods.split(",")}
    if rank == 0:
        report(results, args.out)
    dist.destroy_process_group()


def report(results: dict, out: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="char-GPT: validation loss at the same number of sequences")
    for column in ("method", "sequences", "final validation loss", "vs ddp", "tokens/s"):
        table.add_column(column, justify="right")
    ddp = results.get("ddp", {}).get("final")
    for method, r in results.items():
        ratio = f"{r['final'] / ddp:.3f}x" if ddp else "-"
        table.add_row(method, str(r["curve"][-1][0]), f"{r['final']:.4f}", ratio,
                      f"{r['tokens_per_s']:,.0f}")  # fmt: skip
    Console().print(table)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    for method, r in results.items():
        seen, loss = zip(*r["curve"], strict=True)
        plt.plot(seen, loss, label=method)
    plt.xlabel("sequences seen")
    plt.ylabel("validation loss")
    plt.legend()
    plt.savefig(out.replace(".json", ".png").replace("results", "curves"), dpi=120)


if __name__ == "__main__":
    main()
