"""Solver benchmarks: `dp` solve times at scale, and every solver compared under `evaluate`.

    python benchmarks/solvers.py [--json out.json]

1. `dp` on a synthetic 1,000-layer chain (random costs, seed 0) on flat and hierarchical clusters,
   and on a ~2,000-node captured transformer.
2. `compare` over the published PipeDream profiles (vgg16, resnet50, gnmt; 16 devices flat at
   1.25 GB/s and 4x4 at 10/1.25 GB/s, schedules pipedream and 1f1b) and the zoo models (analytic
   costs, cpu device model, 4 devices), with the geometric-mean gain of `dp` over the best baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile import Cluster, CostGraph, evaluate
from pdcompile.cli.bench_instances import synthetic_chain

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "pipedream"
BASELINES = ("uniform", "params", "blocks")


def scale_rows() -> list[dict]:
    rows = []
    cases = [(1000, "8@300GB/s,128@25GB/s"), (1000, "1024@25GB/s"), (1000, "128@25GB/s"),
             (200, "8@300GB/s,4@25GB/s"), (1000, "8@300GB/s,4@25GB/s")]  # fmt: skip
    for layers, cluster in cases:
        g = synthetic_chain(layers)
        start = time.perf_counter()
        plan = pdcompile.plan(g, Cluster.parse(cluster), schedule="1f1b")
        rows.append({
            "layers": layers, "cluster": cluster, "devices": plan.cluster.num_devices,
            "solve_s": time.perf_counter() - start, "stages": plan.num_stages,
            "predicted_s": plan.predicted_time, "gap": plan.gap,
        })  # fmt: skip
    return rows


def captured_transformer_row() -> dict:
    """`dp` on a ~2,000-node captured GPT (96 blocks, meta device, analytic h100 costs)."""
    import torch

    with torch.device("meta"):
        cfg = pdcompile.zoo.GPTConfig(n_layer=96, n_embd=1024, vocab_size=32000, block_size=512,
                                      n_head=16)  # fmt: skip
        model = pdcompile.zoo.GPT(cfg)
        tokens = torch.zeros(8, 512, dtype=torch.long)
    gm = pdcompile.trace(model, (tokens,))
    costs = pdcompile.analyze(gm, (tokens,), profile=False, device_model="h100")
    start = time.perf_counter()
    plan = pdcompile.plan(costs, Cluster.parse("8@300GB/s"), schedule="1f1b")
    return {
        "layers": len(costs.nodes), "cluster": "8@300GB/s (captured GPT-96)", "devices": 8,
        "solve_s": time.perf_counter() - start, "stages": plan.num_stages,
        "predicted_s": plan.predicted_time, "gap": plan.gap,
    }  # fmt: skip


def zoo_costs() -> dict[str, CostGraph]:
    costs = {}
    for name in ("mlp", "resnet", "gpt", "transformer_encoder", "inception", "unet"):
        model, inputs, *rest = getattr(pdcompile.zoo, name)()
        gm = pdcompile.trace(model, inputs)
        costs[name] = pdcompile.analyze(gm, inputs, profile=False)
    return costs


def compare_rows() -> list[dict]:
    instances = []
    for model in ("vgg16", "resnet50", "gnmt"):
        g = CostGraph.from_pipedream(DATA / model / "graph.txt", batch_size=128)
        for cluster in ("16@1.25GB/s", "4@10GB/s,4@1.25GB/s"):
            for schedule in ("pipedream", "1f1b"):
                instances.append((model, g, cluster, schedule))
    for name, g in zoo_costs().items():
        instances.append((name, g, "4@12.5GB/s", "1f1b"))
    rows = []
    for model, g, cluster_text, schedule in instances:
        cluster = Cluster.parse(cluster_text)
        times, solve = {}, {}
        for solver in pdcompile.solvers():
            start = time.perf_counter()
            try:
                plan = pdcompile.plan(g, cluster, solver=solver, schedule=schedule)
            except pdcompile.PartitionError:
                continue
            solve[solver] = time.perf_counter() - start
            times[solver] = evaluate(plan, g).predicted_time
        best_baseline = min(times[b] for b in BASELINES)
        rows.append({
            "model": model, "cluster": cluster_text, "schedule": schedule, "times": times,
            "solve_s": solve, "dp_gain_over_best_baseline": best_baseline / times["dp"],
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    console = Console(width=160)
    scale = [*scale_rows(), captured_transformer_row()]
    table = Table(title="dp at scale (synthetic chain, schedule 1f1b)")
    for column in ("layers", "cluster", "devices", "solve time", "stages", "predicted", "gap"):
        table.add_column(column, justify="right")
    for r in scale:
        table.add_row(
            str(r["layers"]), r["cluster"], str(r["devices"]), f"{r['solve_s']:.2f} s",
            str(r["stages"]), f"{r['predicted_s'] * 1e3:.3f} ms", f"{r['gap']:.1%}",
        )  # fmt: skip
    console.print(table)

    rows = compare_rows()
    solvers = sorted({s for r in rows for s in r["times"]})
    table = Table(title="predicted time under evaluate, relative to dp (solve time of dp)")
    for column in ("model", "cluster", "schedule", *solvers, "dp solve", "dp gain"):
        table.add_column(column, justify="left" if column in ("model", "cluster") else "right")
    for r in rows:
        dp = r["times"]["dp"]
        cells = [f"{r['times'][s] / dp:.3f}" if s in r["times"] else "-" for s in solvers]
        gain = f"{r['dp_gain_over_best_baseline']:.2f}x"
        table.add_row(r["model"], r["cluster"], r["schedule"], *cells,
                      f"{r['solve_s']['dp']:.3f} s", gain)  # fmt: skip
    console.print(table)
    gains = [r["dp_gain_over_best_baseline"] for r in rows]
    geomean = math.exp(sum(math.log(g) for g in gains) / len(gains))
    console.print(f"geometric-mean gain of dp over the best baseline: {geomean:.2f}x "
                  f"over {len(gains)} instances")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"scale": scale, "compare": rows, "geomean_dp_gain": geomean}, f, indent=1)


if __name__ == "__main__":
    main()
