"""Costs as a function of a microbatch's rows: curves through the row counts profiled. Torch-free.

A node's forward on 1 row is not 1/32 of its forward on 32: a Linear(2048, 2048) reads its whole
16 MB weight for one row as for 32, and every operation pays its framework cost once per call
(on this CPU at one thread: 1.0 ms forward on 1 row, 2.2 ms on 8, 4.8 ms on 32). So `analyze`
measures (or prices) the times at several row counts, and a CostGraph keeps them
(`CostGraph.rows`, each node's `row_s`, the loss's `loss_row_s`: docs/cost_graph.md).

A curve is read (`value_at`) at any row count n from its points (rows r_0 < ... < r_k, times
t_0 <= ... <= t_k): at a profiled count, its point; between two, the straight line joining
them; beyond the largest, a fixed part plus a per-row part, the line through the two largest
points (at large row counts the work grows with the rows); below the smallest, the line through
the two smallest, never below 0. Measured points are made non-decreasing first (`monotone`):
more rows never cost less. A graph of one profile has no points and scales linearly.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from pdcompile.core.errors import CostError

# What a node's `row_s` holds at each row count, in order (`cost_attrs.TIME_ATTRS`).
PARTS = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s")
LOSS_PARTS = ("loss_forward_s", "loss_backward_s")


def check_rows(rows: Any) -> tuple[int, ...]:
    """The profiled row counts as a sorted tuple of distinct integers >= 1, or () for one
    profile (a single count says nothing about scaling: it is ()).

    Raises:
        CostError: not a sequence of integers >= 1, or not strictly increasing.
    """
    if rows is None:
        return ()
    if not isinstance(rows, (list, tuple)) or not all(
        isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in rows
    ):
        raise CostError(f"rows must be a list of row counts (integers >= 1), got {rows!r}")
    if any(a >= b for a, b in zip(rows, rows[1:], strict=False)):
        raise CostError(f"rows must be strictly increasing, got {list(rows)}")
    return tuple(rows) if len(rows) > 1 else ()


def check_points(where: str, points: Any, count: int | None, width: int) -> tuple | None:
    """`points` (None, or `count` entries of `width` seconds each: one per profiled row count;
    any number of at least 2 when `count` is None) as tuples of floats, each part
    non-decreasing in the rows.

    Raises:
        CostError: naming `where`, for a wrong shape, a negative, non-finite or decreasing time.
    """
    if points is None:
        return None
    expected = f"{count} entries" if count is not None else "an entry per row count"
    if (
        not isinstance(points, (list, tuple))
        or len(points) < 2
        or (count is not None and len(points) != count)
    ):
        raise CostError(f"{where}: expected {expected} (the graph's rows), got {points!r}")
    out = []
    for point in points:
        if (
            not isinstance(point, (list, tuple))
            or len(point) != width
            or not all(_seconds(x) for x in point)
        ):
            raise CostError(
                f"{where}: each entry must be {width} finite seconds >= 0, got {point!r}"
            )
        out.append(tuple(float(x) + 0.0 for x in point))
    for k in range(width):
        column = [p[k] for p in out]
        if any(a > b for a, b in zip(column, column[1:], strict=False)):
            raise CostError(
                f"{where}: part {k} decreases with the rows ({column}); more rows never cost "
                "less: make the points monotone (pdcompile.core.row_curves.monotone)"
            )
    return tuple(out)


def monotone(values: Sequence[float], keep: int) -> tuple[float, ...]:
    """`values` (at increasing row counts) made non-decreasing, `values[keep]` unchanged: below
    it each is at most the next one, above it at least the one before.

    >>> monotone([1.0, 3.0, 2.0, 5.0, 4.0], keep=2)
    (1.0, 2.0, 2.0, 5.0, 5.0)
    """
    out = list(values)
    for i in range(keep - 1, -1, -1):
        out[i] = min(out[i], out[i + 1])
    for i in range(keep + 1, len(out)):
        out[i] = max(out[i], out[i - 1])
    return tuple(out)


def value_at(rows: Sequence[int], values: Sequence[float], n: int) -> float:
    """The curve through `(rows[i], values[i])` at `n` rows (module docstring): exact at a
    profiled count; non-decreasing in `n` when `values` are.

    >>> value_at((1, 8, 32), (1.0, 2.0, 5.0), 16), value_at((1, 8, 32), (1.0, 2.0, 5.0), 64)
    (3.0, 9.0)
    """
    if n in rows:
        return values[rows.index(n)]
    if n > rows[-1]:
        i = len(rows) - 2
    elif n < rows[0]:
        i = 0
    else:
        i = next(j for j in range(len(rows) - 1) if rows[j] < n < rows[j + 1])
    slope = (values[i + 1] - values[i]) / (rows[i + 1] - rows[i])
    return max(values[i] + slope * (n - rows[i]), 0.0)


def anchored(
    rows: Sequence[int], points: Sequence[tuple[float, ...]], n: int, at_n: Sequence[float]
) -> tuple[tuple[float, ...], ...]:
    """`points` moved so that the curve reads `at_n` at `n` rows: each part times
    `at_n / value_at(n)`, or, where the curve reads 0 there, plus `at_n`. A graph's node times
    at its batch size anchor its curves, so a time scaled in place (the closed loop's
    `rescaled`, a user's edit) scales its curve alike; unedited, the points come back as they
    were (times 1.0)."""
    moves = []
    for k, target in enumerate(at_n):
        now = value_at(rows, [p[k] for p in points], n)
        moves.append(("*", target / now) if now > 0 else ("+", target))
    return tuple(
        tuple(x * m if op == "*" else x + m for x, (op, m) in zip(p, moves, strict=True))
        for p in points
    )


def node_points(
    rows: Sequence[int], batch_size: int, points: Sequence[tuple[float, ...]] | None,
    times: Sequence[float],
) -> tuple[tuple[float, ...], ...]:  # fmt: skip
    """A node's points anchored at its `times` for `batch_size` rows; a node without points
    (None) gets its times scaled linearly to each row count (what `scaled` does with it)."""
    if points is None:
        return tuple(tuple(t * r / batch_size for t in times) for r in rows)
    return anchored(rows, points, batch_size, times)


def curve_at(rows: Sequence[int], points: Sequence[tuple[float, ...]], n: int) -> tuple:
    """Every part of `points` read at `n` rows."""
    width = len(points[0])
    return tuple(value_at(rows, [p[k] for p in points], n) for k in range(width))


def describe(rows: Sequence[int], how: str = "measured") -> str:
    """How a graph's times depend on the rows (`CostGraph.row_scaling`), `how` they were had.

    >>> describe((1, 4, 32)), describe(())
    ('measured at rows 1, 4, 32', 'assumed linear (one profile)')
    """
    if not rows:
        return "assumed linear (one profile)"
    return f"{how} at rows {', '.join(map(str, rows))}"


def _seconds(x: Any) -> bool:
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    try:
        return 0 <= float(x) < float("inf")
    except OverflowError:
        return False
