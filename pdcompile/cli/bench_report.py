"""Reports of `pdcompile bench-solvers`: a table of every result, a table per solver, and JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from rich.table import Table
from rich.text import Text

from pdcompile.cli.bench_instances import Instance
from pdcompile.cli.solver_bench import BenchResult
from pdcompile.core.text import human_seconds

__all__ = ["pairs_table", "results_json", "results_table", "summary_table"]

FORMAT = "pdcompile.solver_bench"
VERSION = 1


def _sort_key(r: BenchResult) -> tuple[Any, ...]:
    return (r.status != "ok", r.predicted_time if r.predicted_time is not None else 0, r.solver,
            r.schedule)  # fmt: skip


def _several_schedules(results: Sequence[BenchResult]) -> bool:
    return len({r.schedule for r in results}) > 1


def _note(r: BenchResult, width: int = 48) -> str:
    text = r.note.splitlines()[0] if r.note else ""
    return text if len(text) <= width else text[: width - 3] + "..."


def results_table(results: Sequence[BenchResult], title: str | None = None) -> Table:
    """One row per result, grouped by instance and cluster, fastest plan first. With a single
    instance and cluster those columns move into the title."""
    groups: dict[tuple[str, str], list[BenchResult]] = {}
    for r in results:
        groups.setdefault((r.instance, r.cluster), []).append(r)
    single = len(groups) == 1
    several = _several_schedules(results)
    schedule = results[0].schedule if results else "1f1b"
    if title is None:
        where = f"{next(iter(groups))[0]} on {next(iter(groups))[1]}, " if single else ""
        kind = "every schedule" if several else f"schedule {schedule}"
        title = f"{where}{kind}, plans scored under evaluate"
    table = Table(title=Text(title))  # Text: names such as dag:100:1 are not markup or emoji
    columns = ([] if single else ["instance", "cluster"]) + ["solver"] + (
        ["schedule", "step", "step vs best"] if several else []
    ) + [
        "predicted", "vs best", "lower bound", "gap", "stages", "devices",
        "fits memory", "solve time",
    ]  # fmt: skip
    notes = any(r.note for r in results)
    for column in [*columns, *(["note"] if notes else [])]:
        left = column in ("instance", "cluster", "solver", "schedule", "note")
        table.add_column(column, justify="left" if left else "right")
    for key, rows in groups.items():
        for i, r in enumerate(sorted(rows, key=_sort_key)):
            where = [] if single else [key[0] if i == 0 else "", key[1] if i == 0 else ""]
            pair = [r.solver] + ([r.schedule, *_step_cells(r)] if several else [])
            if r.status == "ok":
                assert r.predicted_time is not None and r.gap is not None
                cells = [
                    human_seconds(r.predicted_time),
                    f"{r.ratio_to_best:.3f}" if r.ratio_to_best is not None else "-",
                    human_seconds(r.lower_bound), f"{r.gap:.1%}", str(r.num_stages),
                    str(r.num_devices_used), "yes" if r.fits_memory else "NO",
                    f"{r.solve_time_s:.3f} s",
                ]  # fmt: skip
            else:
                cells = [r.status, "-", human_seconds(r.lower_bound), *["-"] * 5]
            table.add_row(*map(Text, [*where, *pair, *cells, *([_note(r)] if notes else [])]))
        table.add_section()
    return table


def _step_cells(r: BenchResult) -> list[str]:
    if r.status != "ok" or not r.step_time:
        return ["-", "-"]
    return [human_seconds(r.step_time), f"{r.step_ratio:.3f}" if r.step_ratio else "-"]


def pairs_table(results: Sequence[BenchResult]) -> Table:
    """One row per instance and cluster, one column per (solver, schedule) pair: its simulated
    step time (seconds per `train_step` call) and its ratio to the best pair's that fits
    memory (NO: the plan does not fit)."""
    pairs = list(dict.fromkeys((r.solver, r.schedule) for r in results))
    cells: dict[tuple[str, str], dict[tuple[str, str], str]] = {}
    for r in results:
        text = r.status
        if r.status == "ok" and r.step_time:
            ratio = f" ({r.step_ratio:.3f})" if r.step_ratio else ""
            text = human_seconds(r.step_time) + ratio + ("" if r.fits_memory else " NO")
        cells.setdefault((r.instance, r.cluster), {})[(r.solver, r.schedule)] = text
    table = Table(title="step time per (solver, schedule) pair (vs the best pair that fits)")
    for column in ("instance", "cluster"):
        table.add_column(column)
    for solver, schedule in pairs:
        table.add_column(f"{solver} / {schedule}", justify="right")
    for (instance, cluster), row in cells.items():
        table.add_row(*map(Text, [instance, cluster, *(row.get(p, "-") for p in pairs)]))
    return table


def _summary(results: Sequence[BenchResult]) -> list[dict[str, Any]]:
    by_solver: dict[str, list[BenchResult]] = {}
    several = _several_schedules(results)  # then per (solver, schedule) pair, by step time
    for r in results:
        by_solver.setdefault(f"{r.solver} / {r.schedule}" if several else r.solver, []).append(r)
    rows = []
    for solver, rs in by_solver.items():
        ratios = [
            ratio for r in rs if (ratio := r.step_ratio if several else r.ratio_to_best) is not None
        ]
        rows.append({
            "solver": solver, "runs": len(rs), "ok": sum(r.status == "ok" for r in rs),
            "failed": sum(r.status == "failed" for r in rs),
            "timeout": sum(r.status == "timeout" for r in rs),
            "best": sum(bool(r.fits_memory) and (
                (r.step_ratio if several else r.ratio_to_best) or math.inf) <= 1 + 1e-9
                        for r in rs),
            "geomean_ratio": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
            "worst_ratio": max(ratios) if ratios else None,
            "solve_time_s": math.fsum(r.solve_time_s or 0.0 for r in rs),
        })  # fmt: skip
    return sorted(rows, key=lambda s: (s["geomean_ratio"] is None, s["geomean_ratio"] or 0))


def summary_table(results: Sequence[BenchResult]) -> Table:
    """Per solver: runs that gave a plan, how often it was the best, the geometric mean and the
    worst of its ratios to the best, and its total solve time."""
    who = (
        "per (solver, schedule) pair, by step time,"
        if _several_schedules(results)
        else ("per solver,")
    )
    table = Table(title=f"{who} over every instance and cluster")
    for column in ("solver", "plans", "best", "geo-mean vs best", "worst vs best", "solve time"):
        table.add_column(column, justify="left" if column == "solver" else "right")
    for s in _summary(results):
        table.add_row(*map(Text, [
            s["solver"], f"{s['ok']}/{s['runs']}", str(s["best"]),
            f"{s['geomean_ratio']:.3f}" if s["geomean_ratio"] is not None else "-",
            f"{s['worst_ratio']:.3f}" if s["worst_ratio"] is not None else "-",
            f"{s['solve_time_s']:.2f} s" if s["ok"] else "-",
        ]))  # fmt: skip
    return table


def results_json(
    results: Sequence[BenchResult], instances: Sequence[Instance] = (), **settings: Any
) -> str:
    """JSON of the results, the per-solver summary, the instances and the run's `settings`."""
    return json.dumps(
        {
            "format": FORMAT,
            "version": VERSION,
            "settings": settings,
            "instances": [
                {
                    "name": i.name,
                    "source": i.source,
                    "nodes": i.cost_graph.graph.number_of_nodes(),
                    "edges": i.cost_graph.graph.number_of_edges(),
                    "batch_size": i.cost_graph.batch_size,
                }
                for i in instances
            ],  # fmt: skip
            "results": [asdict(r) for r in results],
            "summary": _summary(results),
        },
        indent=1,
    )
