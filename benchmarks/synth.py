"""`schedule="synth"` against every registered synchronous schedule, and on 4 gloo ranks.

    python benchmarks/synth.py [--ranks 4 8] [--run] [--json benchmarks/results/synth.json]

1. Simulated: two stage-time profiles with a heavy last stage, PipeDream's GNMT (its published
   profile, `tests/data/pipedream/gnmt`) and the zoo GPT with a 4096-token LM head (analytic
   costs: the head 4.7x a block; `--vocab`), each planned on p ranks of 10 GB/s, M = 2p and 4p,
   under every registered synchronous schedule (the planner's defaults: dynprog, replicas
   where they pay, each schedule its own partition) and under `synth`. Per case: synth's step
   and peak, the best registered schedule's step among those whose peak is at most synth's
   ("at equal or lower peak memory"), and the shortest registered step at any memory.
   `--pipeline` plans every kind with one replica per stage (`replica_counts=[1]`), where the
   order is all that differs; without it the planner may replicate (on 10 GB/s the GPT's best
   plan is data parallelism, where every kind is the same). `bound`: no order on synth's
   partition can be faster (`fill_bound`), so `1 - bound / best` is the most any synthesised
   order could gain there.
2. `--run`: the GPT with its heavy head compiled with `schedule="synth"` on 4 spawned gloo
   ranks (profiled here, one thread each): the median `train_step` against the plan's
   simulated step (the same on 1f1b for comparison). On a machine with fewer cores than ranks
   the ranks share cores and the times say little.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile import Cluster, CostGraph, zoo

GNMT = "tests/data/pipedream/gnmt/graph.txt"


def gpt(vocab: int) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    cfg = zoo.GPTConfig(vocab_size=vocab, n_layer=8, n_embd=64, dropout=0.0)
    return zoo.GPT(cfg).train(), torch.randint(0, vocab, (8, 32))


def profiles(vocab: int) -> dict[str, CostGraph]:
    model, x = gpt(vocab)
    costs = pdcompile.analyze(pdcompile.trace(model, (x,)), (x,), profile=False)
    return {"gnmt": CostGraph.from_pipedream(GNMT, batch_size=64), f"gpt-{vocab}": costs}


def fill_bound(plan: pdcompile.Plan) -> float:
    """Seconds no schedule on `plan`'s stages beats: for each stage, the forwards before its
    first (the longest chain of earlier stages' forward times) plus its own forwards and
    backwards for its share of the microbatches on one replica. Links and the optimizer count
    nothing."""
    fill = {}
    for s in plan.stages:  # stages are in pipeline (topological) order
        fill[s.index] = max(
            (fill[src] + plan.stages[src].forward_s for src, _ in s.recv_bytes), default=0.0
        )
    share = {s.index: -(-plan.num_microbatches // s.replicas) for s in plan.stages}
    return max(fill[s.index] + share[s.index] * (s.forward_s + s.backward_s) for s in plan.stages)


def compare(costs: CostGraph, p: int, m: int, pipeline: bool = False) -> dict:
    """Every synchronous schedule's plan (step, peak) and synth's (one replica per stage with
    `pipeline`)."""
    counts = {"replica_counts": [1]} if pipeline else {}
    found = {}
    for kind in pdcompile.schedules():
        rules = pdcompile.scheduling.get_schedule(kind)
        if not rules.synchronous:
            continue
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = pdcompile.plan(costs, Cluster.parse(f"{p}@10GB/s"), schedule=kind,
                                      num_microbatches=m, **counts)  # fmt: skip
        except pdcompile.PdcompileError as exc:
            found[kind] = {"skipped": str(exc)[:80]}
            continue
        found[kind] = {"step_time": plan.step_time, "peak": max(plan.rank_memory),
                       "plan_s": time.perf_counter() - start, "bound": fill_bound(plan),
                       "replicas": [s.replicas for s in plan.stages]}  # fmt: skip
    return found


def summary(found: dict) -> dict:
    synth = found["synth"]
    others = {k: v for k, v in found.items() if k != "synth" and "step_time" in v}
    within = {k: v for k, v in others.items() if v["peak"] <= synth["peak"]}
    best_within = min(within, key=lambda k: within[k]["step_time"], default=None)
    best = min(others, key=lambda k: others[k]["step_time"])
    return {
        "synth": synth, "best_within": best_within, "best": best,
        "gain_within": 1 - synth["step_time"] / within[best_within]["step_time"]
        if best_within else None,
        "gain_any": 1 - synth["step_time"] / others[best]["step_time"],
    }  # fmt: skip


def _cell(found: dict) -> str:
    return f"{found['step_time'] * 1e3:.1f} ms, {found['peak'] / 2**20:.0f} MiB"


def _run_rank(rank: int, world: int, init_file: str, vocab: int, schedule: str) -> dict:
    from pdcompile.runtime.distributed import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world, init_file=init_file, backend="gloo", timeout_s=600)
    model, x = gpt(vocab)
    y = torch.randint(0, vocab, x.shape)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    with pdcompile.compile(model, (x[:2],), loss_fn=loss, schedule=schedule,
                           cluster=f"{world}", num_microbatches=2 * world,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01)) as pipe:  # fmt: skip
        batch = x.repeat(2 * world // 4, 1)
        target = y.repeat(2 * world // 4, 1)
        times = []
        for _ in range(12):
            start = time.perf_counter()
            pipe.train_step(batch, target)
            times.append(time.perf_counter() - start)
        return {"median_s": statistics.median(times[2:]), "simulated_s": pipe.plan.step_time}


def run(vocab: int, world: int = 4) -> dict:
    import os
    import tempfile

    import torch.multiprocessing as mp

    results = {}
    for schedule in ("synth", "1f1b"):
        with tempfile.TemporaryDirectory() as tmp:
            ctx = mp.get_context("spawn")
            with ctx.Pool(world) as pool:
                args = [(r, world, os.path.join(tmp, "store"), vocab, schedule)
                        for r in range(world)]  # fmt: skip
                results[schedule] = pool.starmap(_run_rank, args)[0]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--run", action="store_true", help="also run it on 4 gloo ranks")
    parser.add_argument("--pipeline", action="store_true", help="one replica per stage")
    parser.add_argument("--json", default="benchmarks/results/synth.json")
    args = parser.parse_args()
    kind = "one replica per stage" if args.pipeline else "replicas where they pay"
    table = Table(title=f"synth against the registered schedules (simulated, 10 GB/s, {kind})")
    columns = ("profile", "p", "M", "synth", "replicas", "best at <= its peak", "gain",
               "best at any memory", "gain", "bound", "most possible", "planned in")  # fmt: skip
    for column in columns:
        table.add_column(column)
    rows = []
    for name, costs in profiles(args.vocab).items():
        for p in args.ranks:
            for m in (2 * p, 4 * p):
                found = compare(costs, p, m, args.pipeline)
                if "step_time" not in found.get("synth", {}):
                    continue
                s = summary(found)
                rows.append({"profile": name, "p": p, "m": m, "found": found, **s})
                within, best = s["best_within"], s["best"]
                bound = s["synth"]["bound"]
                best_step = found[within or best]["step_time"]
                table.add_row(
                    name, str(p), str(m), _cell(s["synth"]), str(s["synth"]["replicas"]),
                    f"{within} {_cell(found[within])}" if within else "-",
                    f"{s['gain_within']:.1%}" if within else "-",
                    f"{best} {_cell(found[best])}", f"{s['gain_any']:.1%}",
                    f"{bound * 1e3:.1f} ms", f"{1 - bound / best_step:.1%}",
                    f"{s['synth']['plan_s']:.1f} s",
                )  # fmt: skip
    Console(width=220).print(table)
    out = {"args": vars(args), "rows": rows}
    if args.run:
        out["run"] = run(args.vocab)
        for schedule, r in out["run"].items():
            print(f"{schedule} on 4 gloo ranks: median step {r['median_s'] * 1e3:.0f} ms, "
                  f"simulated {r['simulated_s'] * 1e3:.0f} ms "
                  f"({r['median_s'] / r['simulated_s']:.2f}x)")  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
