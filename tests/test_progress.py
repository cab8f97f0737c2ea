"""`pdcompile.core.progress` (issue 30, item 8): long work says what it does and for how long, in a
log as lines with the elapsed time, on a terminal as a bar; short work says nothing; in a
distributed job only rank 0 speaks. A fake clock stands in for the seconds."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from rich.console import Console

import pdcompile
from pdcompile.cli.bench_instances import synthetic_chain
from pdcompile.core import progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The clock progress reads, moved by hand; the ticker never wakes during a test (every line
    comes from the work's own updates), and the mode is the log's."""
    fake = FakeClock()
    monkeypatch.setattr(progress, "_now", fake)
    monkeypatch.setattr(progress, "TICK_S", 3600.0)
    monkeypatch.setenv(progress.ENV, "log")
    monkeypatch.delenv("RANK", raising=False)
    return fake


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The progress lines logged (INFO on `pdcompile.core.progress`), as they are logged."""
    caplog.set_level(logging.INFO, logger=progress.LOGGER)

    class View(list):
        def __iter__(self):  # type: ignore[override]
            return iter(r.getMessage() for r in caplog.records if r.name == progress.LOGGER)

        def __len__(self) -> int:
            return len(list(iter(self)))

    return View()


def test_long_work_logs_what_it_does_with_the_elapsed_time(clock: FakeClock, lines) -> None:
    with progress.phase("planning 1185 nodes on 4 devices"):
        clock.now += 1.0
        for _ in progress.each(["1f1b", "zb-h1", "zb-v"], "schedules"):
            with progress.phase("planning 1185 nodes on 4 devices"):  # the search's own plan()
                clock.now += 1.5
                progress.note("bottleneck within 1e-03, goal 1e-12", 0.4)  # its solver
        clock.now += 20.0
        progress.note("choosing")
    assert list(lines) == [
        # the first line once the work has run THRESHOLD_S (2 s): at 2.5 s
        "planning 1185 nodes on 4 devices: 2 s, 40%: bottleneck within 1e-03, goal 1e-12, "
        "schedules 1/3: 1f1b",
        # the next at least INTERVAL_S (10 s) later
        "planning 1185 nodes on 4 devices: 25 s, choosing",
        "planning 1185 nodes on 4 devices: done in 25 s",
    ]


def test_short_work_says_nothing(clock: FakeClock, lines) -> None:
    with progress.phase("capturing Tiny"):
        for _ in progress.each(range(5), "steps"):
            clock.now += 0.3
            progress.note("working", 0.5)
    assert list(lines) == []


def test_a_search_shows_its_step(clock: FakeClock, lines) -> None:
    with progress.phase("planning 8 nodes on 4 devices"):
        for _ in progress.each([8, 16], "microbatch counts", lambda m: f"M={m}"):
            clock.now += 3.0
    # at 3 s, when the second count starts
    assert list(lines)[0] == "planning 8 nodes on 4 devices: 3 s, microbatch counts 2/2: M=16"


def test_counts_and_minutes(clock: FakeClock, lines) -> None:
    with progress.phase("profiling 312 nodes", total=332) as shown:
        clock.now += 125.0
        shown.advance(40)
    assert list(lines)[0] == "profiling 312 nodes: 2 min 05 s, 40/332"


def test_only_rank_0_speaks_unless_the_work_is_its_own(
    clock: FakeClock, lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    with progress.phase("capturing Gemma3"):
        clock.now += 5.0
        progress.note("torch.export")
    assert list(lines) == []
    with progress.phase("loading stage 1", every_rank=True):
        clock.now += 5.0
        progress.note("weights")
    assert list(lines) == [
        "rank 1: loading stage 1: 5 s, weights",
        "rank 1: loading stage 1: done in 5 s",
    ]


def test_a_failure_inside_leaves_nothing_running(clock: FakeClock, lines) -> None:
    with pytest.raises(KeyError), progress.phase("planning"):
        for _ in progress.each(range(3), "schedules"):
            raise KeyError("boom")
    assert progress._stack == [] and progress._display is None
    progress.note("no phase: nothing happens")


def test_off_and_disabled_say_nothing(
    clock: FakeClock, lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    with progress.phase("profiling", enabled=False) as shown:
        clock.now += 30.0
        shown.advance()
    monkeypatch.setenv(progress.ENV, "off")
    with progress.phase("planning"):
        clock.now += 30.0
        progress.note("still planning")
    assert list(lines) == []


def test_a_terminal_gets_a_bar_that_goes_when_the_work_ends(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(progress.ENV)
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=200)
    # as the CLI shows it: at once, and plan()'s own phase ("planning 120 nodes on 4 devices")
    # adds no part to the CLI's, only the progress of the solver's bisection
    with progress.phase("planning 120 nodes on 4 devices (dp)", console=terminal,
                        threshold_s=0.0):  # fmt: skip
        pdcompile.plan(synthetic_chain(120), 4)
    shown = screen.getvalue()
    assert "planning 120 nodes on 4 devices (dp): 0 s, 100%: bottleneck within 1e-12" in shown


def test_a_script_without_logging_sees_the_lines_on_stderr(tmp_path) -> None:
    """What a torchrun user sees: the program configured no logging, stderr is a pipe."""
    script = textwrap.dedent("""
        import time
        from pdcompile.core import progress
        progress.THRESHOLD_S, progress.TICK_S = 0.05, 0.01
        with progress.phase("capturing Jamba"):
            progress.note("torch.export")
            time.sleep(0.3)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", progress.ENV)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120, check=True)  # fmt: skip
    said = run.stderr.splitlines()
    assert said[0] == "pdcompile: capturing Jamba: 0 s, torch.export"
    assert said[-1] == "pdcompile: capturing Jamba: done in 0 s"
    quiet = "import logging; logging.getLogger('pdcompile.core.progress').setLevel('WARNING')\n"
    run = subprocess.run([sys.executable, "-c", quiet + script], capture_output=True, text=True,
                         env=env, timeout=120, check=True)  # fmt: skip
    assert run.stderr == ""
