"""Costs as a function of the rows per microbatch: predicted against measured steps.

    python benchmarks/row_costs.py [--rounds 3] [--steps 10] [--parts accuracy,search]
                                   [--json out.json] [--default-malloc]

**accuracy** (one process, one thread, the local executor): for an MLP of 2048-wide layers
(`zoo.MLP(64, 2048, 10)`, 8.5 M parameters) and the zoo's GPT (dropout off), 32 rows per
`train_step`, run as 32 microbatches of 1 row, 4 of 8 and 1 of 32 on a one-stage plan
(`compile(..., cluster=1, schedule="1f1b", global_batch_size=32, num_microbatches=M)`, SGD, the
loss priced). The costs are `analyze`'s on the example of 4 rows with `max_rows=32`, what
`compile` runs (so rows 1, 4 and 32 are profiled and 8 is not), taken once per round into a
cache of the round's own and passed to every `compile` of the round (`costs=`). Per row count:
the predicted step (`pipe.plan.step_time`, what `explain()` prints), the prediction the same
profile gave before issue 29 (`before`: the 4 rows' times scaled linearly, the gradients'
accumulation unpriced), and the measured step (median of `--steps`). Then the microbatch-count
search (`global_batch_size=32`, no count) on the same costs: its choice, measured, against the
default count of 4. A round's pipelines are measured taking turns, in `BLOCKS` blocks of steps
after an untimed one each, so that a load that comes and goes falls on all of them alike.

**search** (2 gloo ranks, one thread each, the case of issue 29): the MLP, 128 rows per step,
`cluster="2@1.25Gbit/s"` (the declared link; the ranks talk over loopback), `schedule="1f1b"`.
Measured: the count the search chooses, the default count of 4, and the count the search chose
from the same profile as before issue 29 (`linear`; the issue measured 128 microbatches of 1
row).

The table gives medians over rounds (each round's median over its steps) and, for ratios
predicted / measured, their range. The rounds alternate the models' order; the machine's two
cores are shared, so the spread is part of the result. The ranks run with glibc's malloc
keeping freed memory (`cases.KEEP_FREED_MEMORY`: docs/runtime.md) unless `--default-malloc`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from cases import keep_freed_memory
from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile import CostGraph
from pdcompile.runtime.distributed import init_process_group

ROWS = (1, 8, 32)  # rows per microbatch of the accuracy part
BATCH = 32  # rows per train_step of the accuracy part
EXAMPLE = 4  # the example's rows, as a user would give it
BLOCKS = 2  # turns the pipelines measured together take (timed_steps)
DEFAULT_COUNT = 4  # compile's count when none is given and nothing is searched
SEARCH_BATCH = 128  # rows per train_step of the search part (issue 29's case)
SEARCH_CLUSTER = "2@1.25Gbit/s"


def sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def case(name: str, rows: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, Callable]:
    """(model, inputs of `rows` rows, targets, loss_fn), the same on every call."""
    torch.manual_seed(0)
    if name == "mlp":
        model = pdcompile.zoo.MLP(d_in=64, d_hidden=2048, d_out=10, p=0.0).train()
        return model, torch.randn(rows, 64), torch.randint(0, 10, (rows,)), F.cross_entropy
    model = pdcompile.zoo.GPT(pdcompile.zoo.GPTConfig(dropout=0.0)).train()
    tokens = torch.randint(0, model.cfg.vocab_size, (rows, 16))

    def token_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), targets.flatten())

    return model, tokens, torch.roll(tokens, -1, dims=1), token_loss


def linear(costs: CostGraph) -> CostGraph:
    """The costs as pdcompile had them before issue 29: the example's profile alone, scaled
    linearly, the gradients' accumulation unpriced."""
    graph = costs.graph.copy()
    for _, data in graph.nodes(data=True):
        data["row_s"], data["accumulate_s"] = None, 0.0
    step = {**costs.step_costs(), "rows": (), "loss_row_s": None}
    return CostGraph(graph, costs.batch_size, costs.meta, **step)


def timed_steps(pipes: list[Any], x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    """Each pipeline's median seconds over `steps` train steps, the pipelines taking turns in
    `BLOCKS` blocks (a load that comes and goes falls on all alike), each block after one
    untimed step (the caches the other pipelines' steps left: a step's own)."""
    times: list[list[float]] = [[] for _ in pipes]
    for block in range(BLOCKS):
        for pipe, mine in zip(pipes, times, strict=True):
            pipe.train_step(x, y)
            for _ in range(steps // BLOCKS + (block < steps % BLOCKS)):
                start = time.perf_counter()
                pipe.train_step(x, y)
                mine.append(time.perf_counter() - start)
    return [statistics.median(mine) for mine in times]


def accuracy_round(name: str, steps: int) -> dict:
    model, x, y, loss_fn = case(name, BATCH)
    example = dict(loss_fn=loss_fn, optimizer=sgd)
    gm = pdcompile.trace(model, (x[:EXAMPLE],))
    start = time.perf_counter()
    costs = pdcompile.analyze(gm, (x[:EXAMPLE],), targets=y[:EXAMPLE], max_rows=BATCH,
                              progress=False, **example)  # fmt: skip
    out: dict[str, Any] = {"model": name, "analyze_s": time.perf_counter() - start,
                           "rows_profiled": list(costs.rows), "by_rows": {}}  # fmt: skip
    flat = linear(costs)
    pipes = []
    for count in (*(BATCH // rows for rows in ROWS), None):  # None: the count searched
        model, x, y, loss_fn = case(name, BATCH)
        pipes.append(pdcompile.compile(
            model, (x[:EXAMPLE],), example_targets=y[:EXAMPLE], cluster=1, schedule="1f1b",
            global_batch_size=BATCH, num_microbatches=count, costs=costs, **example,
        ))  # fmt: skip
    measured = timed_steps(pipes, x, y, steps)
    for pipe in pipes:
        pipe.close()
    for rows, pipe, seconds in zip(ROWS, pipes, measured, strict=False):
        count = BATCH // rows
        before = pdcompile.plan(flat, 1, schedule="1f1b", num_microbatches=count,
                                microbatch_size=rows)  # fmt: skip
        out["by_rows"][str(rows)] = {
            "num_microbatches": count, "predicted_s": pipe.plan.step_time,
            "linear_s": before.step_time, "measured_s": seconds,
        }  # fmt: skip
    searched = pipes[-1].plan
    out["search"] = {"num_microbatches": searched.num_microbatches,
                     "predicted_s": searched.step_time, "measured_s": measured[-1]}  # fmt: skip
    default = out["by_rows"][str(BATCH // DEFAULT_COUNT)]
    out["default"] = {"num_microbatches": DEFAULT_COUNT, "measured_s": default["measured_s"]}
    out["load"] = os.getloadavg()[0]
    return out


def _accuracy(rank: int, cache: str, rounds: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # unsettled profiles on a busy machine: reported by spread
    results = []
    for round_ in range(rounds):
        os.environ["PDCOMPILE_CACHE_DIR"] = os.path.join(cache, f"accuracy-{round_}")
        names = ("mlp", "gpt") if round_ % 2 == 0 else ("gpt", "mlp")
        results += [{"round": round_, **accuracy_round(name, steps)} for name in names]
    with open(out, "w") as f:
        json.dump(results, f)


def _search(rank: int, world: int, cache: str, rounds: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    init_process_group(rank, world, init_file=os.path.join(cache, "store"), timeout_s=600)
    results = []
    for round_ in range(rounds):
        os.environ["PDCOMPILE_CACHE_DIR"] = os.path.join(cache, f"search-{round_}")
        model, x, y, loss_fn = case("mlp", SEARCH_BATCH)
        settings = dict(example_targets=y[:EXAMPLE], cluster=SEARCH_CLUSTER, schedule="1f1b",
                        loss_fn=loss_fn, optimizer=sgd, global_batch_size=SEARCH_BATCH)  # fmt: skip
        found: dict[str, Any] = {"round": round_}

        def build(count: int | None, settings: dict = settings) -> Any:
            model, x, _, _ = case("mlp", SEARCH_BATCH)
            return pdcompile.compile(model, (x[:EXAMPLE],), num_microbatches=count, **settings)

        pipes = [build(None)]  # profiles as compile does (rank 1 training meanwhile)
        # what the search chose from the same profile as before issue 29 (rank 0 plans)
        chosen = [0]
        if rank == 0:
            gm = pdcompile.trace(model, (x[:EXAMPLE],))
            costs = pdcompile.analyze(gm, (x[:EXAMPLE],), targets=y[:EXAMPLE], loss_fn=loss_fn,
                                      optimizer=sgd, max_rows=SEARCH_BATCH, progress=False,
                                      loaded_by=world - 1)  # compile's profile, cached  # fmt: skip
            flat = pdcompile.plan(linear(costs), SEARCH_CLUSTER, schedule="1f1b",
                                  global_batch_size=SEARCH_BATCH)  # fmt: skip
            chosen = [flat.num_microbatches]
        dist.broadcast_object_list(chosen, src=0)
        runs = (("search", None), ("default", DEFAULT_COUNT), ("linear", chosen[0]))
        pipes += [build(count) for _, count in runs[1:]]
        measured = timed_steps(pipes, x, y, steps)
        for (what, _), pipe, seconds in zip(runs, pipes, measured, strict=True):
            found[what] = {"num_microbatches": pipe.plan.num_microbatches,
                           "predicted_s": pipe.plan.step_time, "measured_s": seconds}  # fmt: skip
            pipe.close()
        results.append(found)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def median(values: list[float]) -> float:
    return statistics.median(values)


def ratio_text(pairs: list[tuple[float, float]]) -> str:
    ratios = [p / m for p, m in pairs]
    return f"{median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


def accuracy_table(results: list[dict], steps: int) -> Table:
    table = Table(title=f"predicted vs measured train_step, one process, one thread, {BATCH} "
                  f"rows per step (median of {len({r['round'] for r in results})} rounds x "
                  f"{steps} steps)")  # fmt: skip
    for column in ("model", "rows", "M", "measured", "predicted", "ratio [range]",
                   "before (linear)", "ratio"):  # fmt: skip
        table.add_column(column, justify="left" if column == "model" else "right")
    for name in ("mlp", "gpt"):
        mine = [r for r in results if r["model"] == name]
        for rows in ROWS:
            cells = [r["by_rows"][str(rows)] for r in mine]
            pred = [(c["predicted_s"], c["measured_s"]) for c in cells]
            lin = [(c["linear_s"], c["measured_s"]) for c in cells]
            table.add_row(
                name, str(rows) + ("" if rows in mine[0]["rows_profiled"] else " (not profiled)"),
                str(BATCH // rows), f"{median([c['measured_s'] for c in cells]) * 1e3:.1f} ms",
                f"{median([c['predicted_s'] for c in cells]) * 1e3:.1f} ms", ratio_text(pred),
                f"{median([c['linear_s'] for c in cells]) * 1e3:.1f} ms", ratio_text(lin),
            )  # fmt: skip
    return table


def search_table(accuracy: list[dict], search: list[dict]) -> Table:
    table = Table(title="the microbatch-count search: its choice against the default count of "
                  f"{DEFAULT_COUNT}, measured (median of rounds)")  # fmt: skip
    for column in ("case", "chosen M", "measured", "predicted", f"M={DEFAULT_COUNT} measured",
                   "chosen / default", "before, chose", "its measured"):  # fmt: skip
        table.add_column(column, justify="left" if column == "case" else "right")
    rows: list[tuple[str, list[dict]]] = [
        (f"{n}, 1 process, {BATCH} rows", [r for r in accuracy if r["model"] == n])
        for n in ("mlp", "gpt")
    ]
    if search:
        rows.append((f"mlp, 2 ranks {SEARCH_CLUSTER}, {SEARCH_BATCH} rows", search))
    for label, mine in rows:
        if not mine:
            continue
        counts = sorted({str(r["search"]["num_microbatches"]) for r in mine})
        chosen = median([r["search"]["measured_s"] for r in mine])
        default = median([r["default"]["measured_s"] for r in mine])
        lin = [r["linear"] for r in mine if "linear" in r]
        table.add_row(
            label, "/".join(counts), f"{chosen * 1e3:.1f} ms",
            f"{median([r['search']['predicted_s'] for r in mine]) * 1e3:.1f} ms",
            f"{default * 1e3:.1f} ms", f"{chosen / default:.2f}",
            "/".join(sorted({str(c["num_microbatches"]) for c in lin})) if lin else "-",
            f"{median([c['measured_s'] for c in lin]) * 1e3:.1f} ms" if lin else "-",
        )  # fmt: skip
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    parser.add_argument("--parts", default="accuracy,search")
    parser.add_argument("--json", help="write every round and the machine's load here")
    parser.add_argument(
        "--default-malloc", action="store_true",
        help="glibc's malloc defaults (its thresholds move with the heap)",
    )  # fmt: skip
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    keep_freed_memory(args.default_malloc)
    malloc = os.environ.get("GLIBC_TUNABLES", "default")
    load = os.getloadavg()
    accuracy: list[dict] = []
    search: list[dict] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if "accuracy" in parts:
            out = os.path.join(tmp, "accuracy.json")
            mp.start_processes(_accuracy, args=(tmp, args.rounds, args.steps, out), nprocs=1,
                               start_method="spawn")  # fmt: skip
            with open(out) as f:
                accuracy = json.load(f)
        if "search" in parts:
            out = os.path.join(tmp, "search.json")
            mp.start_processes(_search, args=(2, tmp, args.rounds, args.steps, out), nprocs=2,
                               start_method="spawn")  # fmt: skip
            with open(out) as f:
                search = json.load(f)
    wall = time.perf_counter() - start
    console = Console(width=160)
    if accuracy:
        console.print(accuracy_table(accuracy, args.steps))
        seconds = {n: median([r["analyze_s"] for r in accuracy if r["model"] == n])
                   for n in ("mlp", "gpt")}  # fmt: skip
        profiled = {r["model"]: r["rows_profiled"] for r in accuracy}
        console.print(
            f"analyze (rows profiled, median seconds): mlp {profiled['mlp']} "
            f"{seconds['mlp']:.1f} s, gpt {profiled['gpt']} {seconds['gpt']:.1f} s"
        )
    if accuracy or search:
        console.print(search_table(accuracy, search))
    console.print(f"{wall:.0f} s in all; load average before {load[0]:.1f}, after "
                  f"{os.getloadavg()[0]:.1f}; malloc: {malloc}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"malloc": malloc, "load_before": load, "load_after": os.getloadavg(),
                       "accuracy": accuracy, "search": search}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
