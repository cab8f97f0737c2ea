"""`pdcompile.pictures.gantt`: bubble fractions (pure) and Gantt charts drawn from Event lists."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdcompile.core.errors import PdcompileError
from pdcompile.passes.planning.timeline import Event
from pdcompile.pictures import gantt
from pdcompile.pictures.gantt import KINDS, bubble_fraction, plot_timelines, rows, time_unit

MS = 1e-3


def two_stage_gpipe(num_microbatches: int = 4, origin: float = 0.0) -> list[Event]:
    """A hand-made 2-rank GPipe step: forwards of 1 ms, backwards of 2 ms, sends of 0.1 ms."""
    events = []
    for k in range(num_microbatches):
        t = origin + k * MS
        events += [Event(0, "F", 0, k, t, t + MS), Event(0, "send", 0, k, t + MS, t + 1.1 * MS, 1),
                   Event(1, "recv", 1, k, t + MS, t + 1.1 * MS, 0),
                   Event(1, "F", 1, k, t + 1.1 * MS, t + 2.1 * MS)]  # fmt: skip
    turn = origin + (num_microbatches + 1.1) * MS
    for k in reversed(range(num_microbatches)):
        i = num_microbatches - 1 - k
        t = turn + 2 * i * MS
        events += [Event(1, "B", 1, k, t, t + 2 * MS), Event(0, "B", 0, k, t + 2 * MS, t + 4 * MS)]
    end = max(e.end for e in events)
    for rank in (0, 1):
        events += [Event(rank, "allreduce", rank, -1, end, end + 0.5 * MS),
                   Event(rank, "step", rank, -1, end + 0.5 * MS, end + 0.6 * MS)]  # fmt: skip
    return events


def test_bubble_fraction_is_the_idle_share_of_the_span() -> None:
    events = [Event(0, "F", 0, 0, 10.0, 11.0), Event(0, "send", 0, 0, 11.0, 12.0, 1),
              Event(0, "B", 0, 0, 12.0, 14.0)]  # fmt: skip
    assert bubble_fraction(events) == pytest.approx(0.25)  # own span 4 s, 3 s computing
    assert bubble_fraction(events, span=6.0) == pytest.approx(0.5)
    assert bubble_fraction([]) == 0.0
    assert bubble_fraction([Event(0, "recv", 0, 0, 0.0, 1.0, 1)]) == 1.0
    assert bubble_fraction([Event(0, "F", 0, 0, 0.0, 0.0)]) == 0.0  # empty span


def test_rows_group_by_rank_in_time_order_and_units_fit_the_span() -> None:
    events = two_stage_gpipe()
    by_rank = rows(reversed(events))
    assert list(by_rank) == [0, 1]
    assert [e.start for e in by_rank[1]] == sorted(e.start for e in by_rank[1])
    assert time_unit(2.5) == ("s", 1.0) and time_unit(0.02) == ("ms", 1e-3)
    assert time_unit(5e-4) == ("us", 1e-6)


def test_png_and_svg_show_every_rank_with_its_bubble(tmp_path: Path) -> None:
    events = two_stage_gpipe()
    png, svg = tmp_path / "g.png", tmp_path / "g.svg"
    plot_timelines([("one step", events)], png)
    plot_timelines([("one step", events)], svg)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    text = svg.read_text()
    span = max(e.end for e in events)
    for rank in (0, 1):
        mine = [e for e in events if e.rank == rank]
        assert f"rank {rank} (stage {rank})" in text
        assert f"bubble {bubble_fraction(mine, span):.0%}" in text
    for kind in ("F", "B", "send", "recv", "allreduce", "step"):  # each kind in its colour
        label, colour = KINDS[kind]
        assert label in text and colour in text, kind
    assert KINDS["clip"][1] not in text  # only kinds that occur are drawn and listed
    assert "one step (" in text and "time (ms)" in text
    assert ">3<" in text.replace("\n", "")  # microbatch numbers on the wide boxes


def test_panels_stack_in_one_time_unit(tmp_path: Path) -> None:
    measured = two_stage_gpipe(4, origin=1234.5)  # perf_counter times: shifted to 0
    simulated = two_stage_gpipe(8)
    target = tmp_path / "both.svg"
    plot_timelines([("measured", measured), ("simulated", simulated)], target)
    text = target.read_text()
    assert text.index("measured (") < text.index("simulated (")
    assert text.count("time (ms)") == 1 and text.count("rank 1 (stage 1)") == 2
    assert "1.23e+06" not in text  # each panel starts at its first event


def test_bad_paths_empty_panels_and_missing_matplotlib_are_clear(tmp_path, monkeypatch) -> None:
    with pytest.raises(PdcompileError, match=r"must end in \.png or \.svg"):
        plot_timelines([("x", two_stage_gpipe())], tmp_path / "g.pdf")
    with pytest.raises(PdcompileError, match="panel 'empty' has no events"):
        plot_timelines([("empty", [])], tmp_path / "g.png")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(PdcompileError, match=r"pdcompile\[plot\]"):
        plot_timelines([("x", two_stage_gpipe())], tmp_path / "g.png")


def test_a_chart_too_large_to_draw_is_refused_at_once(tmp_path: Path) -> None:
    many = [Event(0, "F", 0, k, k * MS, (k + 1) * MS) for k in range(gantt.MAX_DRAWN_EVENTS + 1)]
    with pytest.raises(PdcompileError, match=r"200,001 actions in 1 rank rows is too large"):
        plot_timelines([("many", many)], tmp_path / "many.png")
    wide = [Event(r, "F", r, 0, 0.0, MS) for r in range(gantt.MAX_DRAWN_RANKS + 1)]
    with pytest.raises(PdcompileError, match=r"in 513 rank rows is too large to draw"):
        plot_timelines([("wide", wide)], tmp_path / "wide.png")
    assert not list(tmp_path.iterdir())
