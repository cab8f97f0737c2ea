"""PipeDream's optimizer re-implemented (`pdcompile.passes.planning.solvers.pipedream_optimizer`)
against the
original, on every run recorded in tests/data/pipedream_reference/vgg16_resnet50.json.

Per run: the original's "Time per stage in pipeline" and ours, their relative error, whether the
replica counts and the state boundaries of the printed tables agree ("tie" where they differ only
between equally good plans: tests/test_pipedream_solver.py checks that both are optimal), our
solve time (median of `--repeats` solves, states included) and the original's solve time where it
was measured (resnet50, 16 devices at 1.25 GB/s: 13.7 s; 4x4 at 10 and 1.25 GB/s: 43 s).

    python benchmarks/pipedream_solver.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pdcompile.core.cost_graph import CostGraph
from pdcompile.passes.planning.solvers.pipedream_optimizer import optimize_pipedream

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
# seconds the unmodified original took (single run), by (model, config)
ORIGINAL_SECONDS = {("resnet50", "A_16flat"): 13.7, ("resnet50", "A_4x4"): 43.0}


def describe(options: dict) -> str:
    """`servers x GPUs @ outer/inner GB/s` and the flags set (outermost level first)."""
    machines = "x".join(str(m) for m in reversed(options["num_machines"]))
    links = "/".join(f"{b / 1e9:g}" for b in reversed(options["bandwidths"]))
    flags = [
        name
        for name, on in (
            ("straight", options["straight_pipeline"]),
            (f"mem {options['memory_size'] / 1e9:g} GB", options["use_memory_constraint"]),
            ("fewer", options["use_fewer_machines"]),
            ("no comm", options["activation_compression_ratio"] is None),
        )
        if on
    ]
    return " ".join([f"{machines} @ {links} GB/s", *flags])


def same(match: bool) -> str:
    return "same" if match else "tie"


def measure(ref: dict, graphs: dict[str, CostGraph], repeats: int) -> dict:
    options = dict(ref["options"])
    machines, bandwidths = options.pop("num_machines"), options.pop("bandwidths")
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = optimize_pipedream(graphs[ref["model"]], machines, bandwidths, **options)
        seconds.append(time.perf_counter() - start)
    ours = [[row[3] for row in table] for table in result.levels]
    theirs = [[row[3] for row in table] for table in ref["levels"]]
    return {
        "model": ref["model"],
        "config": ref["config"],
        "options": ref["options"],
        "reference_time_per_stage": ref["time_per_stage"],
        "time_per_stage": result.time_per_stage,
        "rel_error": abs(result.time_per_stage - ref["time_per_stage"]) / ref["time_per_stage"],
        "num_states": result.num_states,
        "reference_num_states": ref["num_states"],
        "replicas_match": ours == theirs,
        "bounds_match": [[list(row[:2]) for row in t] for t in result.levels]
        == [[row[:2] for row in t] for t in ref["levels"]],
        "replicas": ours,
        "reference_replicas": theirs,
        "solve_s": statistics.median(seconds),
        "original_solve_s": ORIGINAL_SECONDS.get((ref["model"], ref["config"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5, help="solves per run (median)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args()
    reference = json.loads((DATA / "pipedream_reference" / "vgg16_resnet50.json").read_text())
    graphs = {
        model: CostGraph.from_pipedream(DATA / "pipedream" / model / "graph.txt")
        for model in sorted({r["model"] for r in reference})
    }
    rows = [measure(ref, graphs, args.repeats) for ref in reference]
    table = Table(title=f"PipeDream optimizer: original vs pdcompile (median of {args.repeats})")
    for column in ("model", "config", "options", "states", "original s/stage", "ours s/stage",
                   "rel. error", "replicas", "bounds", "ours solve", "original solve"):  # fmt: skip
        left = column in ("model", "config", "options")
        table.add_column(column, justify="left" if left else "right")
    for r in rows:
        original = r["original_solve_s"]
        table.add_row(
            r["model"], r["config"], describe(r["options"]), str(r["num_states"]),
            f"{r['reference_time_per_stage']:.9g}", f"{r['time_per_stage']:.9g}",
            f"{r['rel_error']:.1e}", same(r["replicas_match"]), same(r["bounds_match"]),
            f"{r['solve_s'] * 1e3:.1f} ms", "" if original is None else f"{original:.1f} s",
        )  # fmt: skip
    Console(width=180).print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
