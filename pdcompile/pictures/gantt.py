"""Gantt charts of timelines, measured or simulated: one row per rank, one box per action.

`plot_timelines([(title, events), ...], "out.png")` draws one panel per timeline, stacked, in
one time unit. Forward, backward, clipping and the optimizer step (compute), send and
all-reduce (communication) have distinct colours; a receive is drawn as idle time, grey and
hatched: the rank waits there for the message (its transfer included), and the legend keeps
idle apart from communication. Forward and backward boxes carry their microbatch number when
wide enough; an overlapped pair (`FB`) is outlined around its forward and backward; each row is
labelled "rank r (stage s)" with its bubble fraction. Needs
matplotlib (the `plot` extra), imported only when drawing; `bubble_fraction` is pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pdcompile.core.errors import PdcompileError
from pdcompile.passes.planning.timeline import Event, shifted
from pdcompile.scheduling.action_kinds import TABLE, is_compute

# kind -> (legend label, colour), from the action table; kinds without a colour (push, pop,
# check) are drawn grey, unlabelled
KINDS = {row.letter: (row.label, row.colour) for row in TABLE if row.colour}
OTHER = "#bbbbbb"
# kinds drawn as idle: hatched, in the legend after a blank "idle" box
IDLE = tuple(row.letter for row in TABLE if row.drawn_as_idle)
_HATCH = ("////", "#9a9a9a")  # the idle boxes' hatching and its colour
# kinds drawn as thin boxes at the bottom of a row: they may overlap compute
_COMM = tuple(row.letter for row in TABLE if row.thin)
# kinds drawn as an outline around the compute boxes after them (an overlapped pair's parts)
_BRACKETS = {row.letter: row.brackets for row in TABLE if row.brackets}
_FORMATS = (".png", ".svg")
_FONT = 7  # points, of the microbatch numbers
_WIDTH_IN = 12  # figure width, inches
# what one chart draws at most: beyond, matplotlib takes minutes and no box is visible; a row is
# 0.45 inch at 150 dpi, so 512 rows are 35,000 pixels (Agg draws at most 65,536)
MAX_DRAWN_EVENTS = 200_000
MAX_DRAWN_RANKS = 512


def bubble_fraction(events: Iterable[Event], span: float | None = None) -> float:
    """The idle share of a rank: 1 - forward and backward time / `span`.

    Args:
        events: one rank's events.
        span: the time the rank is accounted over (a chart uses its panel's span, from the
            earliest start to the latest end over all ranks, so a rank waiting for its first
            activation counts as idle); None: the rank's own first start to last end.

    Returns:
        the fraction in [0, 1]; 0 for no events or an empty span.

    Example:
        >>> bubble_fraction([Event(0, "F", 0, 0, 0.0, 1.0), Event(0, "B", 0, 0, 2.0, 4.0)])
        0.25
    """
    events = list(events)
    if span is None and events:
        span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.duration for e in events if is_compute(e.kind))
    return min(1.0, max(0.0, 1.0 - busy / span)) if span else 0.0


def rows(events: Iterable[Event]) -> dict[int, list[Event]]:
    """Events by rank, ranks in order."""
    by_rank: dict[int, list[Event]] = {}
    for e in sorted(events, key=lambda e: (e.rank, e.start)):
        by_rank.setdefault(e.rank, []).append(e)
    return by_rank


def time_unit(span: float) -> tuple[str, float]:
    """The unit to show `span` seconds in: (name, seconds per unit)."""
    for name, scale in (("s", 1.0), ("ms", 1e-3)):
        if span >= scale:
            return name, scale
    return "us", 1e-6


def plot_timelines(panels: Sequence[tuple[str, Sequence[Event]]], path: str | Path) -> None:
    """Draw each (title, events) as a Gantt panel, stacked vertically, to a PNG or SVG.

    Each panel's times start at its earliest event; all panels share one time unit and scale,
    so a measured run and its simulation compare by length.

    Raises:
        PdcompileError: `path` is not .png or .svg, a panel has no events, the chart is too
            large (`MAX_DRAWN_EVENTS`, `MAX_DRAWN_RANKS`), or matplotlib is missing.
    """
    path = Path(path)
    if path.suffix.lower() not in _FORMATS:
        raise PdcompileError(f"cannot draw {path}: the file name must end in .png or .svg")
    panels = [(title, shifted(events)) for title, events in panels]
    for title, events in panels:
        if not events:
            raise PdcompileError(f"panel {title!r} has no events to draw")
    _check_size(panels)
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise PdcompileError(
            "drawing timelines needs matplotlib: pip install 'pdcompile[plot]'"
        ) from None

    spans = [max(e.end for e in events) for _, events in panels]
    longest = max(spans)
    unit, scale = time_unit(longest)
    heights = [len(rows(events)) + 1.5 for _, events in panels]
    fig = Figure(figsize=(_WIDTH_IN, 0.45 * sum(heights) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    kinds: set[str] = set()
    for ax, (title, events), span in zip(axes, panels, spans, strict=True):
        kinds |= _draw_panel(ax, events, span, 1 / scale, longest)
        ax.set_title(f"{title} ({span / scale:.3g} {unit})", fontsize=10, loc="left")
    axes[-1].set_xlabel(f"time ({unit})")
    axes[-1].set_xlim(0, longest / scale * 1.01)
    handles = [
        Patch(label=label, **({"facecolor": "none", "edgecolor": c} if k in _BRACKETS else
                              {"facecolor": c, **_idle_style(k)}))
        for k, (label, c) in KINDS.items()
        if k in kinds
    ]  # fmt: skip
    if kinds - KINDS.keys():
        handles.append(Patch(color=OTHER, label="other"))
    handles.append(Patch(facecolor="white", edgecolor=_HATCH[1], label="idle: no action"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG text stays text
        fig.savefig(path, dpi=150)


def _check_size(panels: Sequence[tuple[str, Sequence[Event]]]) -> None:
    """Refuse a chart too large to draw (`MAX_DRAWN_EVENTS`, `MAX_DRAWN_RANKS`)."""
    drawn = sum(len(events) for _, events in panels)
    ranks = sum(len({e.rank for e in events}) for _, events in panels)
    if drawn > MAX_DRAWN_EVENTS or ranks > MAX_DRAWN_RANKS:
        raise PdcompileError(
            f"a Gantt chart of {drawn:,} actions in {ranks:,} rank rows is too large to draw "
            f"(pdcompile.pictures.gantt.MAX_DRAWN_EVENTS = {MAX_DRAWN_EVENTS:,}, MAX_DRAWN_RANKS "
            f"= {MAX_DRAWN_RANKS}): draw fewer microbatches (--microbatches) or ranks; the "
            "Chrome trace (--trace) holds any size"
        )


def _draw_panel(
    ax: Any, events: Sequence[Event], span: float, per_s: float, longest: float
) -> set[str]:
    """One rank per row on the axes `ax`, times times `per_s`; returns the kinds drawn."""
    width_pt = _WIDTH_IN * 72 * 0.8  # the plotting area, roughly, for `longest` seconds
    kinds: set[str] = set()
    labels = []
    for y, (rank, mine) in enumerate(rows(events).items()):
        stages = sorted({e.stage for e in mine if is_compute(e.kind)})  # several: chunks
        stage = f"stage{'s' * (len(stages) > 1)} {', '.join(map(str, stages)) or '?'}"
        labels.append(f"rank {rank} ({stage})\nbubble {bubble_fraction(mine, span):.0%}")
        for kind in dict.fromkeys(e.kind for e in mine):
            boxes = [(e.start * per_s, e.duration * per_s) for e in mine if e.kind == kind]
            lane = (y + 0.1, 0.25) if kind in _COMM else (y - 0.4, 0.8)
            colour = KINDS.get(kind, ("", OTHER))[1]
            if kind in _BRACKETS:
                boxes = [(a * per_s, d * per_s) for a, d in _pairs(mine, kind)]
                ax.broken_barh(boxes, (y - 0.45, 0.9), facecolors="none", edgecolors=colour,
                               linewidth=0.8)  # fmt: skip
            else:
                style = _idle_style(kind) or {"edgecolor": "white", "linewidth": 0.3}
                ax.broken_barh(boxes, lane, facecolors=colour, **style)
            kinds.add(kind)
        for e in mine:
            text = str(e.microbatch)
            fits = e.duration / longest * width_pt > 0.7 * _FONT * (len(text) + 1)
            if is_compute(e.kind) and e.microbatch >= 0 and fits:
                ax.text((e.start + e.duration / 2) * per_s, y, text, ha="center", va="center",
                        fontsize=_FONT, color="white")  # fmt: skip
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    return kinds


def _pairs(mine: Sequence[Event], kind: str) -> list[tuple[float, float]]:
    """(start, duration) of each of one rank's overlapped pairs opened by `kind`: from its
    bracket to the end of its last part (the events right after it)."""
    n = _BRACKETS[kind]
    return [
        (e.start, max(p.end for p in mine[i : i + 1 + n]) - e.start)
        for i, e in enumerate(mine)
        if e.kind == kind
    ]


def _idle_style(kind: str) -> dict[str, Any]:
    """Hatching for the kinds drawn as idle ({} for the others)."""
    return {"hatch": _HATCH[0], "edgecolor": _HATCH[1], "linewidth": 0} if kind in IDLE else {}


def plot_simulation(sim: Any, path: str | Path, title: str | None = None) -> None:
    """Draw a `Simulation`'s timeline as a Gantt chart (one row per rank) to `path`."""
    plan = sim.plan
    default = (
        f"simulated {plan.schedule}, {plan.num_stages} stages, {plan.num_microbatches} microbatches"
    )
    plot_timelines([(title or default, sim.timeline)], path)
