"""Capture every zoo model: path taken, node count, parameters and time to capture (median).

python benchmarks/capture.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile.core.ir import AUTO_LEAVES, CAPTURE


def measure(name: str, repeats: int) -> dict:
    factory = getattr(pdcompile.zoo, name)
    times = []
    for _ in range(repeats):
        model, args, *rest = factory()
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pdcompile.TraceWarning)
            gm = pdcompile.trace(model, args, example_kwargs=rest[0] if rest else None)
        times.append(time.perf_counter() - start)
    return {
        "model": name,
        "class": type(model).__name__,
        "path": gm.meta[CAPTURE],
        "nodes": len(gm.graph.nodes),
        "params": sum(p.numel() for p in model.parameters()),
        "auto_leaves": [n for n, _ in gm.meta[AUTO_LEAVES]],
        "capture_s_median": statistics.median(times),
        "capture_s_all": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pdcompile.trace(*pdcompile.zoo.mlp())  # warm-up: first-call imports are not capture time
    rows = [measure(name, args.repeats) for name in [*pdcompile.zoo.ZOO, *pdcompile.zoo.HF_ZOO]]
    table = Table(title=f"capture, median of {args.repeats}, torch {torch.__version__}, 1 thread")
    for column in ("model", "class", "path", "nodes", "params", "auto leaves", "capture s"):
        table.add_column(column, justify="right" if column in ("nodes", "params") else "left")
    for r in rows:
        table.add_row(
            r["model"], r["class"], r["path"], str(r["nodes"]), f"{r['params']:,}",
            ", ".join(r["auto_leaves"]) or "-", f"{r['capture_s_median']:.3f}",
        )  # fmt: skip
    Console(width=140).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
