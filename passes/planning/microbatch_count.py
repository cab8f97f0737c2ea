"""`plan(..., global_batch_size=G)`: the microbatch count chosen for a fixed batch. Torch-free.

A microbatch count is a choice only for a fixed batch: G rows per `train_step` run as M
microbatches of G / M rows. More microbatches shorten the pipeline's fill and drain (the bubble)
and hold fewer bytes per microbatch in flight; fewer pay fewer per-message latencies, runtime
costs (`Cluster.runtime`) and all-reduce rounds. With `global_batch_size` (and no
`num_microbatches`), `plan()` plans every count M that divides G and that the schedule accepts,
each with its own partition and replicas (the solver's, at G / M rows per microbatch), and
returns the plan with the smallest simulated `step_time` among those that fit memory (ties:
fewer microbatches). `options["microbatches"]` lists every count tried, JSON-native. A G with
more than `MAX_COUNTS` such divisors has `MAX_COUNTS` of them tried, spread evenly on a log scale
from 1 to the largest (G = 10**12: 63 divisors up to the cap took 24 s to plan, 16 take a few);
a G over `MAX_GLOBAL_BATCH` is refused.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError
from pdcompile.core.progress import each
from pdcompile.core.text import human_bytes, human_seconds
from pdcompile.passes.planning.plan_config import PlanConfig, Planner
from pdcompile.passes.planning.plans import Plan
from pdcompile.scheduling.base import MAX_MICROBATCHES

SEARCH_KEY = "microbatches"  # plan.options key of the table of counts tried
TIE = 1e-9  # step times within this share of each other are a tie
MAX_COUNTS = 16  # microbatch counts a search plans at most
MAX_GLOBAL_BATCH = 2**53  # rows the cost model counts exactly (float64 integers)
# (id(graph), rows) -> (graph, graph.scaled(rows)) while a search runs (`shared_scaling`)
_SCALED: ContextVar[dict[tuple[int, int], tuple[CostGraph, CostGraph]] | None] = ContextVar(
    "pdcompile_scaled", default=None
)


@contextmanager
def shared_scaling() -> Iterator[None]:
    """Within it, `scaled_to` makes each `CostGraph.scaled(rows)` once: a search plans the same
    graph at the same microbatch sizes for every schedule and layout (on the zoo GPT, 114
    scalings of 7 sizes took a third of `schedule="auto"`). Nested uses share the outer one."""
    token = _SCALED.set({}) if _SCALED.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _SCALED.reset(token)


def scaled_to(cost_graph: CostGraph, rows: int) -> CostGraph:
    """`cost_graph` at `rows` per microbatch: itself at its own batch size, else
    `cost_graph.scaled(rows)`, made once per `shared_scaling` block."""
    if rows == cost_graph.batch_size:
        return cost_graph
    memo = _SCALED.get()
    if memo is None:
        return cost_graph.scaled(rows)
    key = (id(cost_graph), rows)  # the memo holds the graph, so its id stays its own
    if key not in memo:
        memo[key] = (cost_graph, cost_graph.scaled(rows))
    return memo[key][1]


def divisors(n: int, cap: int = MAX_MICROBATCHES) -> list[int]:
    """The divisors of `n` up to `cap`, ascending (at most `cap` trial divisions, whatever `n`).

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def spread(counts: Sequence[int], most: int = MAX_COUNTS) -> list[int]:
    """At most `most` of the ascending `counts`: all of them if they are few, else the first, the
    last and those nearest (on a log scale) to points evenly spaced between them.

    >>> spread([1, 2, 3, 4, 6, 8, 12, 16, 24, 48], 4)
    [1, 4, 12, 48]
    """
    if len(counts) <= most:
        return list(counts)
    first, last = math.log(counts[0]), math.log(counts[-1])
    chosen = set()
    for i in range(most):
        target = first + (last - first) * i / (most - 1)
        chosen.add(min(counts, key=lambda c: abs(math.log(c) - target)))
    return sorted(chosen)


def fastest_fitting(plans: Sequence[Plan]) -> int:
    """The index of the plan with the smallest `step_time` among those that fit memory (all,
    if none fits); the first of those within `TIE` of it, so that ties go to the earlier."""
    fitting = [i for i, p in enumerate(plans) if p.fits_memory] or range(len(plans))
    fastest = min(plans[i].step_time for i in fitting)
    return next(i for i in fitting if plans[i].step_time <= fastest * (1 + TIE))


def batch_settings(
    cost_graph: CostGraph,
    global_batch_size: int,
    num_microbatches: int | None,
    microbatch_size: int | None,
) -> list[tuple[int, int]]:
    """(M, rows per microbatch) pairs that split `global_batch_size` rows evenly: every divisor
    of it, or the one pair `num_microbatches` or `microbatch_size` fixes.

    Raises:
        PartitionError: G is no integer >= 1, the fixed count or size does not divide it, or
            the CostGraph has no batch size to scale from.
    """
    g = global_batch_size
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise PartitionError(
            f"global_batch_size must be an integer >= 1 (rows per step), got {g!r}"
        )
    if g > MAX_GLOBAL_BATCH:
        raise PartitionError(
            f"global_batch_size={g} is more rows per step than the cost model counts exactly "
            f"(at most 2**53 = {MAX_GLOBAL_BATCH}); give the rows one train_step runs"
        )
    if cost_graph.batch_size is None:
        raise PartitionError(
            "global_batch_size needs a CostGraph with a batch_size to scale its costs from "
            "(PipeDream profiles record none: CostGraph.from_pipedream(..., batch_size=N))"
        )
    if num_microbatches is not None and microbatch_size is not None:
        if num_microbatches * microbatch_size != g:
            raise PartitionError(
                f"num_microbatches={num_microbatches} x microbatch_size={microbatch_size} is not "
                f"global_batch_size={g}; give two of the three"
            )
        return [(num_microbatches, microbatch_size)]
    fixed, name = (num_microbatches, "num_microbatches") if num_microbatches else (
        microbatch_size, "microbatch_size")  # fmt: skip
    if fixed is not None:
        if g % fixed:
            raise PartitionError(
                f"{name}={fixed} does not divide global_batch_size={g} into equal microbatches; "
                f"use one of {divisors(g)[:12]}"
            )
        return [(fixed, g // fixed)] if fixed == num_microbatches else [(g // fixed, fixed)]
    return [(m, g // m) for m in spread(divisors(g))]


def plan_microbatches(inner: Planner, cost_graph: CostGraph, config: PlanConfig) -> Plan:
    """With `global_batch_size` G, the fastest fitting plan over `batch_settings`, `inner` (the
    planner's next layer) planning each count M at G // M rows per microbatch; else `inner`'s
    plan.

    A count the schedule refuses (or that cannot be planned) is listed with the reason. Without
    a fitting plan the fastest is returned (its `fits_memory` False, as `plan()` returns it).

    Raises:
        PartitionError: no count could be planned (the message gives the first reasons).
    """
    g = config.global_batch_size
    if g is None:
        return inner(cost_graph, config)
    settings = batch_settings(cost_graph, g, config.num_microbatches, config.microbatch_size)
    start = time.perf_counter()
    found: list[tuple[Plan, list[warnings.WarningMessage]]] = []
    rows: list[dict[str, Any]] = []
    with shared_scaling():
        for m, size in each(settings, "microbatch counts", lambda s: f"M={s[0]}"):
            one = config.replace(num_microbatches=m, microbatch_size=size, global_batch_size=None)
            _plan_count(inner, scaled_to(cost_graph, size), one, found, rows)
    if not found:
        reasons = "; ".join(f"M={r['num_microbatches']}: {r['skipped']}" for r in rows[:3])
        more = f" (and {len(rows) - 3} more)" if len(rows) > 3 else ""
        raise PartitionError(
            f"no microbatch count of global_batch_size={g} could be planned: {reasons}{more}"
        )
    best, caught = found[fastest_fitting([p for p, _ in found])]
    for row in rows:
        row["chosen"] = row["num_microbatches"] == best.num_microbatches
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    options = {**best.options, SEARCH_KEY: rows, "global_batch_size": g}
    return best.with_(options=options, solve_time_s=time.perf_counter() - start)


def _plan_count(
    inner: Planner,
    cost_graph: CostGraph,
    config: PlanConfig,
    found: list[tuple[Plan, list[warnings.WarningMessage]]],
    rows: list[dict[str, Any]],
) -> None:
    """Plan one count (`config`'s; `cost_graph` already at its rows), adding it to `found` and
    `rows`."""
    m, size = config.num_microbatches, config.microbatch_size
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = inner(cost_graph, config)
        except PartitionError as exc:
            rows.append({"num_microbatches": m, "microbatch_size": size, "skipped": str(exc)})
            return
    found.append((result, list(caught)))
    rows.append({
        "num_microbatches": m, "microbatch_size": size, "step_time": result.step_time,
        "fits_memory": result.fits_memory, "peak_memory": max(result.rank_memory, default=0),
        "skipped": None,
    })  # fmt: skip


def counts_table(plan: Plan) -> str:
    """The counts `plan` was chosen among (`options["microbatches"]`) as text; "" without."""
    rows = plan.options.get(SEARCH_KEY) or []
    if not rows:
        return ""
    batch = plan.options.get("global_batch_size")
    lines = [f"microbatch counts of the {batch} rows per step (* chosen: the fastest that fits):"]
    for r in rows:
        mark = "*" if r.get("chosen") else " "
        split = f"M={r['num_microbatches']} x {r['microbatch_size']} rows"
        if r["skipped"]:
            lines.append(f"{mark} {split}: skipped: {r['skipped']}")
            continue
        fits = "" if r["fits_memory"] else ", does NOT fit"
        lines.append(f"{mark} {split}: step {human_seconds(r['step_time'])}, peak memory "
                     f"{human_bytes(r['peak_memory'])}{fits}")  # fmt: skip
    return "\n".join(lines)
