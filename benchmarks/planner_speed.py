"""Planner speed (issue 32): every target against the figures measured before, medians of 3.

    python benchmarks/planner_speed.py [--repeats 3] [--json benchmarks/results/planner_speed.json]

Rows (seconds, median of `--repeats` runs in this process, after one warm-up where noted):
- `dynprog` on PipeDream's NASNet-large profile (1,251 nodes), 16 devices at 1.25 GB/s: the
  solver's own time (`plan.solve_time_s`) and the whole `plan()` (simulation of the plan too).
- `dynprog` on a 1,000-layer synthetic chain on 1,024 devices, flat and as 128 servers of 8.
- `dynprog` on a 20,000-node chain on 4 devices.
- `schedule="auto"` with `global_batch_size` on the zoo GPT (8 blocks, 163 nodes) and on a
  Hugging Face Llama of 13 blocks (1,042 nodes, through torch.export) on 4@10GB/s.
- the `pipedream` solver on resnet50, 16 devices at 1.25 GB/s, against the original optimizer's
  13.7 s (benchmarks/pipedream_solver.py): the optimizer alone and the whole `plan()`.
- a cold `pdcompile.trace` of a small model in a fresh interpreter: whether torch._dynamo or
  torch._inductor were imported, and its wall time.
The machine's load average is printed with the table; figures on a loaded machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile import Cluster, CostGraph, PlanWarning
from pdcompile.cli.bench_instances import synthetic_chain
from pdcompile.core.cluster import RuntimeCosts
from pdcompile.passes.planning.solver_kit import SOLVERS
from pdcompile.passes.planning.solvers.pipedream_optimizer import optimize_pipedream

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "pipedream"
ORIGINAL_PIPEDREAM_S = 13.7  # the unmodified original on resnet50, 16 devices at 1.25 GB/s
# (what, the figure before issue 32, the goal)
BEFORE = {
    "nasnet": ("8.6-12.4 s", 2.0),
    "chain_1024": ("0.9 s (docs), solver only", 2.0),
    "chain_128x8": ("1.6 s (docs), solver only", 2.0),
    "chain_20000": ("39 rounds x 20,000 ends (111 s)", 10.0),
    "auto_gpt": ("tens of seconds", 10.0),
    "auto_hf": ("new row", 30.0),
    "pipedream": ("67x (was 86x)", None),
    "trace": ("imports both, 1.2 s idle", None),
}


def _median(fn, repeats: int) -> tuple[float, object]:
    seconds, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def _quiet(fn):
    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PlanWarning)
            return fn()

    return run


def dynprog_rows(repeats: int) -> list[dict]:
    rows = []
    nasnet = CostGraph.from_pipedream(DATA / "nasnetalarge" / "graph.txt")
    cases = [
        ("nasnet", "NASNet-large (1,251 nodes), 16@1.25GB/s", nasnet, "16@1.25GB/s"),
        ("chain_1024", "chain 1,000 layers, 1024@25GB/s", synthetic_chain(1000), "1024@25GB/s"),
        ("chain_128x8", "chain 1,000 layers, 8@300GB/s,128@25GB/s", synthetic_chain(1000),
         "8@300GB/s,128@25GB/s"),
        ("chain_20000", "chain 20,000 nodes, 4@25GB/s", synthetic_chain(20000), "4@25GB/s"),
    ]  # fmt: skip
    pdcompile.plan(nasnet, Cluster.parse("4@1GB/s"))  # warm-up: the solvers' modules load
    for key, label, costs, text in cases:
        cluster = Cluster.parse(text)
        if cluster.num_devices > 64:  # plan() would simulate 1,024 ranks x 2,048 microbatches
            options = {"schedule": "1f1b", "num_microbatches": 2 * cluster.num_devices,
                       "even_microbatches": True}  # fmt: skip
            seconds, plan = _median(lambda c=costs, k=cluster, o=options: SOLVERS.get("dynprog")(
                c, k, o), repeats)  # fmt: skip
            answer = f"{plan.predicted_time:.9g} s/microbatch"
            rows.append({"key": key, "what": f"dynprog: {label}", "seconds": seconds,
                         "plan_s": None, "answer": answer})  # fmt: skip
            continue
        solves = []

        def once(costs=costs, cluster=cluster, solves=solves):
            plan = pdcompile.plan(costs, cluster, schedule="1f1b")
            solves.append(plan.solve_time_s)
            return plan

        seconds, plan = _median(_quiet(once), repeats)
        rows.append({
            "key": key, "what": f"dynprog: {label}", "seconds": statistics.median(solves),
            "plan_s": seconds, "answer": f"{plan.predicted_time:.9g} s/microbatch",
        })  # fmt: skip
    return rows


def auto_rows(repeats: int) -> list[dict]:
    """`schedule="auto"` with `global_batch_size` on the zoo GPT and on a Hugging Face Llama of
    13 blocks (1,042 nodes, captured through torch.export), analytic costs."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = pdcompile.zoo.GPTConfig(dropout=0.0, n_layer=8)
    tokens = torch.randint(0, config.vocab_size, (8, 32))
    gm = pdcompile.trace(pdcompile.zoo.GPT(config).train(), (tokens,))
    gpt = pdcompile.analyze(gm, (tokens,), profile=False, progress=False)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=13, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )).train()  # fmt: skip
    ids = {"input_ids": torch.randint(0, 128, (8, 16))}
    gm = pdcompile.trace(llama, (), example_kwargs=ids)
    hf = pdcompile.analyze(gm, (), example_kwargs=ids, profile=False, progress=False)
    cluster = Cluster.parse("4@10GB/s", runtime=RuntimeCosts(message_s=1e-4))
    rows = []
    for key, name, costs in (("auto_gpt", "zoo GPT", gpt), ("auto_hf", "HF Llama", hf)):
        batch = 2 * cluster.num_devices * costs.batch_size
        seconds, plan = _median(_quiet(lambda c=costs, b=batch: pdcompile.plan(
            c, cluster, schedule="auto", global_batch_size=b)), repeats)  # fmt: skip
        rows.append({
            "key": key, "what": f"auto, global_batch_size={batch}: {name} "
            f"({len(costs.nodes)} nodes), 4@10GB/s", "seconds": seconds, "plan_s": seconds,
            "answer": f"{plan.schedule} M={plan.num_microbatches} {plan.step_time:.9g} s/step",
        })  # fmt: skip
    return rows


def pipedream_row(repeats: int) -> dict:
    costs = CostGraph.from_pipedream(DATA / "resnet50" / "graph.txt")
    cluster = Cluster.parse("16@1.25GB/s")
    optimizer, result = _median(lambda: optimize_pipedream(costs, [16], [1.25e9]), repeats)
    whole, _ = _median(_quiet(lambda: pdcompile.plan(costs, cluster, solver="pipedream")), repeats)
    return {
        "key": "pipedream", "what": "pipedream solver: resnet50, 16@1.25GB/s (optimizer; plan)",
        "seconds": optimizer, "plan_s": whole,
        "answer": f"{result.time_per_stage:.9g} s/stage; {ORIGINAL_PIPEDREAM_S / optimizer:.0f}x "
        f"the original (optimizer), {ORIGINAL_PIPEDREAM_S / whole:.0f}x (plan)",
    }  # fmt: skip


TRACE = """
import sys, time
start = time.perf_counter()
import torch, pdcompile
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
pdcompile.trace(model, (torch.randn(4, 8),))
print(time.perf_counter() - start)
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


def trace_row(repeats: int) -> dict:
    seconds, imported = [], ""
    for _ in range(repeats):
        env = {**os.environ, "PDCOMPILE_PROGRESS": "off"}
        out = subprocess.run([sys.executable, "-c", TRACE], capture_output=True, text=True,
                             env=env, check=True)  # fmt: skip
        wall, imported = out.stdout.strip().splitlines()[-2:]
        seconds.append(float(wall))
    return {
        "key": "trace", "what": "cold import + pdcompile.trace (fx), fresh interpreter",
        "seconds": statistics.median(seconds), "plan_s": None, "answer": f"imported {imported}",
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/planner_speed.json")
    args = parser.parse_args()
    load = os.getloadavg()
    rows = [*dynprog_rows(args.repeats), *auto_rows(args.repeats), pipedream_row(args.repeats),
            trace_row(args.repeats)]  # fmt: skip
    table = Table(title=f"planner speed, medians of {args.repeats} (load average "
                  f"{load[0]:.1f}, {os.cpu_count()} CPUs)")  # fmt: skip
    for column in ("what", "solver / main", "plan()", "before", "goal", "answer"):
        table.add_column(column, justify="left" if column in ("what", "answer") else "right")
    for r in rows:
        before, goal = BEFORE[r["key"]]
        table.add_row(
            r["what"], f"{r['seconds']:.3f} s",
            "" if r["plan_s"] is None else f"{r['plan_s']:.3f} s", before,
            "" if goal is None else f"< {goal:g} s", r["answer"],
        )  # fmt: skip
    Console(width=200).print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"load": load, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
