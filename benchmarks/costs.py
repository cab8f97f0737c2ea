"""Fidelity of the cost passes on the zoo's MLP, residual CNN and GPT-style decoder.

For each model, side by side in one run at one CPU thread:
- profiled: the sum over nodes of the profiled forward + backward seconds (`pdcompile.analyze`);
- measured: the median time of a whole training step (forward and backward) of the unmodified
  model on the same batch;
- ratio = profiled / measured (the target is within 15%);
- Spearman rank correlation between analytic (roofline, `cpu` preset) and profiled forward +
  backward times over the large nodes (those holding 80% of the profiled time);
- the wall time of profiling (cache off).

    python benchmarks/costs.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import pdcompile

MODELS = ("mlp", "resnet", "gpt")


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(x: list[float]) -> np.ndarray:
        values = np.asarray(x)
        order = values.argsort(kind="stable")
        r = np.empty(len(values))
        r[order] = np.arange(len(values))
        for v in np.unique(values):  # ties share their average rank
            r[values == v] = r[values == v].mean()
        return r

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def step_time(model: torch.nn.Module, inputs: tuple, repeats: int) -> float:
    times = []
    for _ in range(3 + repeats):
        start = time.perf_counter()
        out = model(*inputs)
        out.float().sum().backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[3:])


def measure(name: str, repeats: int) -> dict:
    model, inputs = getattr(pdcompile.zoo, name)()[:2]
    gm = pdcompile.trace(model, inputs)
    start = time.perf_counter()
    costs = pdcompile.analyze(gm, inputs, cache=False, progress=False)
    profile_s = time.perf_counter() - start
    analytic = pdcompile.analyze(gm, inputs, profile=False)
    measured = step_time(model, inputs, repeats * 4)
    nodes = costs.graph.nodes
    profiled = {n: nodes[n]["forward_s"] + nodes[n]["backward_s"] for n in costs.nodes}
    total = sum(profiled.values())
    large, covered = [], 0.0
    for n in sorted(profiled, key=profiled.get, reverse=True):
        if covered >= 0.8 * total:
            break
        large.append(n)
        covered += profiled[n]
    a = analytic.graph.nodes
    estimates = [a[n]["forward_s"] + a[n]["backward_s"] for n in large]
    return {
        "model": name,
        "nodes": len(costs.nodes),
        "profiled_fwd_bwd_s": total,
        "measured_step_s": measured,
        "ratio": total / measured,
        "large_nodes": len(large),
        "spearman_analytic_vs_profiled": spearman(estimates, [profiled[n] for n in large]),
        "profile_wall_s": profile_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5, help="rounds per model (medians)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = {name: [measure(name, 5) for _ in range(args.repeats)] for name in MODELS}
    rows = []
    for name, results in rounds.items():
        row = {k: statistics.median(r[k] for r in results) for k in results[0] if k != "model"}
        rows.append({"model": name, **row, "rounds": results})
    table = Table(title=f"cost fidelity, medians of {args.repeats} rounds, 1 CPU thread")
    for column in ("model", "nodes", "profiled fwd+bwd", "measured step", "ratio",
                   "large nodes", "Spearman", "profiling wall"):  # fmt: skip
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in rows:
        table.add_row(
            r["model"], f"{r['nodes']:.0f}", f"{r['profiled_fwd_bwd_s'] * 1e3:.3f} ms",
            f"{r['measured_step_s'] * 1e3:.3f} ms", f"{r['ratio']:.3f}", f"{r['large_nodes']:.0f}",
            f"{r['spearman_analytic_vs_profiled']:.3f}", f"{r['profile_wall_s']:.2f} s",
        )  # fmt: skip
    Console(width=140).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
