"""`plan(..., schedule="auto")`: schedule, chunks, microbatches, partition and replicas chosen
together, the fastest plan that fits.

Each registered schedule (the synchronous ones; the asynchronous ones too with
`allow_async=True`) is planned exactly as `plan(..., schedule=name, chunks=v)` would plan it, for
each of its `auto_chunks`: the solver finds the partition and replicas under that schedule's
memory counts and prices, and with `global_batch_size` every microbatch count dividing the batch
is planned too (`microbatch_count`). Every candidate is scored by its simulated `step_time` (the
cost model's numbers, the simulator's), and the smallest among those that fit device memory is
returned: the minimum over every (schedule, chunks, microbatches) plan by construction; ties,
within `TIE`, go to the simpler schedule (the built-ins in the registry's order), then fewer
chunks. Its `options["auto"]` holds the best plan per (schedule, chunks), one row each
(JSON-native, so it survives `Plan.to_json`), rendered by `auto_table` and
`PipelinedModule.explain()`. Torch-free.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError
from pdcompile.core.progress import each
from pdcompile.core.text import human_bytes, human_seconds
from pdcompile.passes.planning.microbatch_count import (
    SEARCH_KEY,
    divisors,
    fastest_fitting,
    shared_scaling,
)
from pdcompile.passes.planning.order_search import refinements
from pdcompile.passes.planning.plan_config import PlanConfig, Planner
from pdcompile.passes.planning.plans import Plan
from pdcompile.scheduling import get_schedule, schedules
from pdcompile.scheduling.registry import SCHEDULES

AUTO = "auto"


def candidates(allow_async: bool = False) -> list[tuple[str, int]]:
    """(schedule, chunks) pairs `schedule="auto"` plans, in tie-break order.

    >>> candidates()[:3]
    [('1f1b', 1), ('gpipe', 1), ('interleaved-1f1b', 2)]
    """
    pairs = []
    for name in sorted(schedules(), key=_simplicity):
        rules = get_schedule(name)
        if (rules.synchronous or allow_async) and not rules.fits_plans:
            pairs += [(name, v) for v in sorted(rules.auto_chunks)]
    return pairs


def _simplicity(name: str) -> tuple[int, str]:
    """Built-in schedules in the registry's order (1f1b, gpipe, pipedream, 2bw, interleaved-1f1b,
    zb-h1, zb-h2, zb-v), then the others by name."""
    module = type(get_schedule(name)).__module__
    builtins = SCHEDULES.builtins
    return (builtins.index(module) if module in builtins else len(builtins), name)


def check_auto_chunks(chunks: Any) -> None:
    """Raise `PartitionError` unless `chunks` is None: "auto" chooses them."""
    if chunks is not None:
        raise PartitionError(
            "schedule='auto' chooses the chunks per rank itself; leave chunks out or name "
            "a schedule"
        )


def layouts(
    num_devices: int, chunks: int, replica_counts: Sequence[int] | None
) -> list[tuple[int, ...] | None]:
    """The replica counts `plan_auto` plans a candidate with: the solver's free choice (None),
    and with one stage per rank every pipeline of d replicas a stage, d dividing the devices
    (straight, the pipeline x data-parallel grid, pure data parallelism). The solvers minimise
    the bottleneck stage, which a pipeline and its replicated twin can share while their fill
    and drain differ: the step time tells them apart. The caller's `replica_counts` (or chunks,
    one replica each) leave the solver's choice only.

    >>> layouts(4, 1, None)
    [None, (1,), (2,), (4,)]
    """
    if replica_counts is not None or chunks > 1:
        return [None if replica_counts is None else tuple(replica_counts)]
    return [None, *((d,) for d in divisors(num_devices))]


def plan_auto(inner: Planner, cost_graph: CostGraph, config: PlanConfig) -> Plan:
    """With schedule="auto", the fastest fitting plan over `candidates(allow_async)` and their
    `layouts`, `inner` (the planner's next layer) planning each with its schedule, chunks and
    replica counts; else `inner`'s plan.

    A candidate that cannot be planned (e.g. it does not accept the `num_microbatches` given) is
    listed with the reason and skipped. Without a fitting candidate, the fastest of all is
    returned (its `fits_memory` is False, as `plan()` would return it).

    Raises:
        PartitionError: no candidate could be planned (the message gives each one's reason).
    """
    if not config.auto:
        return inner(cost_graph, config)
    check_auto_chunks(config.chunks)
    devices = config.cluster.num_devices
    start = time.perf_counter()
    found: list[tuple[int, Plan, list[warnings.WarningMessage]]] = []
    rows: list[dict[str, Any]] = []

    def plan_one(**changes: Any) -> Plan:
        return inner(cost_graph, config.replace(**changes))

    with shared_scaling():  # every schedule plans the same microbatch sizes
        for name, chunks in each(candidates(config.allow_async), "schedules", _candidate):
            tried = layouts(devices, chunks, config.replica_counts)
            _plan_candidate(plan_one, name, chunks, tried, found, rows)
    if not found:
        reasons = "; ".join(f"{r['schedule']} (chunks={r['chunks']}): {r['skipped']}" for r in rows)
        raise PartitionError(f"schedule='auto': no schedule could be planned: {reasons}")
    # ties go to the first: equal closed forms summed in another order differ in the last bits,
    # and the simpler schedule should win that tie
    index, best, caught = found[fastest_fitting([p for _, p, _ in found])]
    for fitted in refinements(best):  # kinds fitting their orders to a plan: to the best one
        rows.append({"schedule": fitted.schedule, "chunks": rows[index]["chunks"],
                     **_row(fitted)})  # fmt: skip
        if fastest_fitting([best, fitted]) == 1:
            index, best = len(rows) - 1, fitted
    for i, row in enumerate(rows):
        row["chosen"] = i == index
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    options = {**best.options, AUTO: rows}
    return best.with_(options=options, solve_time_s=time.perf_counter() - start)


def _plan_candidate(
    plan_one: Callable[..., Plan],
    name: str,
    chunks: int,
    layouts_: list[tuple[int, ...] | None],
    found: list[tuple[int, Plan, list[warnings.WarningMessage]]],
    rows: list[dict[str, Any]],
) -> None:
    """Plan one candidate schedule over its replica layouts (`plan_one`: `plan` of the graph on
    the cluster with the other settings), adding it to `found` and `rows`."""
    row: dict[str, Any] = {"schedule": name, "chunks": chunks}
    mine: list[tuple[Plan, list[warnings.WarningMessage]]] = []
    reasons = []
    for counts in layouts_:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = plan_one(schedule=name, chunks=chunks, replica_counts=counts)
            except PartitionError as exc:
                reasons.append(str(exc))
                continue
        mine.append((result, list(caught)))
    if not mine:
        rows.append({**row, "skipped": reasons[0]})
        return
    result, caught = mine[fastest_fitting([p for p, _ in mine])]
    found.append((len(rows), result, caught))
    rows.append({**row, **_row(result)})


def _candidate(candidate: tuple[str, int]) -> str:
    """A candidate as progress names it: `zb-v, 2 chunks`."""
    name, chunks = candidate
    return name if chunks == 1 else f"{name}, {chunks} chunks"


def _row(plan: Plan) -> dict[str, Any]:
    idle = plan.rank_idle
    tried = plan.options.get(SEARCH_KEY) or []
    return {
        "step_time": plan.step_time,
        "predicted_time": plan.predicted_time,
        "bubble": sum(idle) / len(idle) if idle else 0.0,
        "num_microbatches": plan.num_microbatches,
        "microbatch_size": plan.microbatch_size,
        "counts_tried": [r["num_microbatches"] for r in tried if not r["skipped"]],
        "num_stages": plan.num_stages,
        "replicas": [s.replicas for s in plan.stages],
        "fits_memory": plan.fits_memory,
        "peak_memory": max(plan.rank_memory, default=0),
        "skipped": None,
    }


def auto_table(rows: Sequence[Mapping[str, Any]] | Plan) -> str:
    """The comparison table of `plan.options["auto"]` (or of those rows) as text; "" without."""
    if isinstance(rows, Plan):
        rows = rows.options.get(AUTO) or []
    if not rows:
        return ""
    best = next((r["step_time"] for r in rows if r.get("chosen")), 0.0)
    searched = any(r.get("counts_tried") for r in rows)
    lines = [("", "schedule", "chunks", "replicas", "M", "step", "vs chosen", "bubble",
              "peak memory", "fits")]  # fmt: skip
    for r in rows:
        mark = "*" if r.get("chosen") else ""
        if r.get("skipped"):
            lines.append((mark, r["schedule"], str(r["chunks"]), "-", "-", "skipped", "-", "-",
                          "-", "-"))  # fmt: skip
            continue
        count = str(r["num_microbatches"])
        if searched:  # the count chosen, of those planned
            count += f" of {','.join(map(str, r.get('counts_tried') or ()))}"
        lines.append((
            mark, r["schedule"], str(r["chunks"]), ",".join(map(str, r.get("replicas") or ())),
            count,
            human_seconds(r["step_time"]),
            f"{r['step_time'] / best - 1:+.1%}" if best else "-",
            f"{r['bubble']:.1%}", human_bytes(r["peak_memory"]),
            "yes" if r["fits_memory"] else "NO",
        ))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    batch = next((r["num_microbatches"] * r["microbatch_size"] for r in rows
                  if r.get("chosen") and r.get("microbatch_size")), None)  # fmt: skip
    head = "schedule='auto' candidates (* chosen: the fastest that fits"
    head += f"; M microbatches of the {batch} rows per step):" if searched else "):"
    text = [head] + [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    ]
    text += [
        f"skipped {r['schedule']} (chunks={r['chunks']}): {r['skipped']}"
        for r in rows
        if r.get("skipped")
    ]
    return "\n".join(text)
