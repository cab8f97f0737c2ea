"""Progress of work that takes more than a few seconds: a bar on a terminal, lines in a log.

Capture (`trace`), costs (`analyze`, profiling), planning (`plan`) and its searches over
microbatch counts and schedules each run inside a `phase`. A phase nested in another adds its
own part to the outer one's display; a nested phase with the description of one it runs in (a
`plan()` that a search calls) adds nothing. Work shorter than `THRESHOLD_S` shows nothing.

Where it shows (`PDCOMPILE_PROGRESS`, a debug knob: "bar", "log" or "off"; by default "bar"
where standard error is a terminal, else "log"):

- bar: a rich spinner (and a bar, where the work says how far it is) with the elapsed time,
  drawn on standard error and erased when the work ends.
- log: a record at INFO on the logger `pdcompile.core.progress` once the work has run `THRESHOLD_S`,
  then every `INTERVAL_S`, and one when it ends, e.g.
  `pdcompile: planning 1185 nodes on 4 devices: 12 s, schedules 3/7: zb-h1`. Where the program
  configured no logging (no handler on the way to the root logger: a plain script or a torchrun
  job), pdcompile prints these lines to standard error itself, so that a long silence in a log
  is never unexplained; where it configured logging, its handlers and levels decide
  (`logging.getLogger("pdcompile.core.progress").setLevel(logging.INFO)` shows them under a root
  logger at WARNING). Setting that logger's level above INFO silences them either way.

In a distributed job (torch.distributed initialised, or `RANK` set as torchrun sets it) only
rank 0 shows progress, since every rank runs the same phases; a phase that one other rank runs
alone passes `every_rank=True` and its lines start with the rank.

Torch-free. Solvers report how far they are with `note(detail, fraction=)`.

Example:
    >>> with phase("profiling 312 nodes", total=332) as shown:
    ...     for run in runs:
    ...         run()
    ...         shown.advance()
    (after 2 s, in a log) pdcompile: profiling 312 nodes: 2 s, 40/332
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

LOGGER = "pdcompile.core.progress"
ENV = "PDCOMPILE_PROGRESS"  # "bar", "log" or "off"; unset: bar on a terminal, else log
THRESHOLD_S = 2.0  # work that ends sooner shows nothing
INTERVAL_S = 10.0  # log mode: one line per this many seconds of work
TICK_S = 0.25  # how often the display looks at the work while nothing reports

log = logging.getLogger(LOGGER)
_now: Callable[[], float] = time.monotonic  # tests put a fake clock here
_lock = threading.RLock()
_stack: list[Phase] = []  # the phases running, outermost first
_display: _Display | None = None  # the outermost phase's display, while it runs
T = TypeVar("T")


class Phase:
    """One piece of work being shown: its description and how far it is."""

    def __init__(self, description: str, total: float | None) -> None:
        self.description = description
        self.total = total
        self.done: float | None = 0 if total is not None else None
        self.detail = ""
        self.fraction: float | None = None

    def update(
        self, detail: str | None = None, *, done: float | None = None, total: float | None = None
    ) -> None:
        """Say what runs now (`detail`) and how far the work is (`done` of `total`)."""
        with _lock:
            if detail is not None:
                self.detail = detail
            if total is not None:
                self.total = total
            if done is not None:
                self.done = done
        _refresh()

    def advance(self, steps: float = 1) -> None:
        """`steps` more of `total` are done."""
        self.update(done=(self.done or 0) + steps)

    def progress(self) -> str:
        """How far this phase is, as shown: `3/7: zb-h1`, `40%`, or a detail alone."""
        if self.total:
            done = f"{self.done or 0:g}/{self.total:g}"
        else:
            done = f"{self.fraction:.0%}" if self.fraction is not None else ""
        return ": ".join(t for t in (done, self.detail) if t)

    def completed(self) -> float | None:
        """The share done, 0 to 1, where known."""
        if self.total:
            return min((self.done or 0) / self.total, 1.0)
        return self.fraction


class _Display:
    """Shows the phases of `_stack` from when the outermost has run `threshold` seconds."""

    def __init__(self, mode: str, threshold: float, prefix: str, console: Any) -> None:
        self.mode, self.threshold, self.prefix, self.console = mode, threshold, prefix, console
        self.start = _now()
        self.next_line = threshold  # log mode: elapsed seconds of the next line
        self.shown = False
        self.bar: Any = None
        self.task: Any = None
        self.stop = threading.Event()
        self.ticker = threading.Thread(target=self._tick, name="pdcompile-progress", daemon=True)
        self.ticker.start()

    def _tick(self) -> None:
        while not self.stop.wait(TICK_S):
            self.refresh()

    def text(self) -> str:
        """`planning 1185 nodes on 4 devices: 12 s, schedules 3/7: zb-h1`."""
        (outer, how), *inner = _visible()
        parts = [f"{self.prefix}{outer.description}: {_elapsed(_now() - self.start)}"]
        parts += [how.progress()] if how.progress() else []
        parts += [" ".join(t for t in (p.description, h.progress()) if t) for p, h in inner]
        return ", ".join(parts)

    def refresh(self, final: bool = False) -> None:
        with _lock:
            if not _stack:
                return
            elapsed = _now() - self.start
            if elapsed < self.threshold and not self.shown:
                return
            if self.mode == "log":
                if final and self.shown:
                    _say(f"{self.prefix}{_stack[0].description}: done in {_elapsed(elapsed)}")
                elif not final and elapsed >= self.next_line:
                    _say(self.text())
                    self.shown = True
                    self.next_line = elapsed + INTERVAL_S
                return
            if not self.shown:
                self._start_bar()
            fraction = next((f for _, p in reversed(_visible())
                             if (f := p.completed()) is not None), None)  # fmt: skip
            self.bar.update(self.task, description=self.text(), total=1.0 if fraction is not None
                            else None, completed=fraction or 0)  # fmt: skip
            if final:
                self.bar.refresh()

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn

        columns = (SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(),
                   TaskProgressColumn())  # fmt: skip
        console = self.console or Console(stderr=True)
        self.bar = Progress(*columns, console=console, transient=True)
        self.task = self.bar.add_task("", total=None)
        self.bar.start()
        self.shown = True

    def close(self) -> None:
        self.stop.set()
        if self.ticker is not threading.current_thread():
            self.ticker.join()
        self.refresh(final=True)
        if self.bar is not None:
            self.bar.stop()


@contextmanager
def phase(
    description: str,
    *,
    total: float | None = None,
    enabled: bool = True,
    every_rank: bool = False,
    console: Any = None,
    threshold_s: float | None = None,
) -> Iterator[Phase]:
    """Show `description` while the `with` block runs, if it runs longer than `THRESHOLD_S`.

    Args:
        description: what runs, e.g. "planning 1185 nodes on 4 devices".
        total: steps of the work, where known (`Phase.advance` counts them).
        enabled: False shows nothing (the block still gets a `Phase` to report to).
        every_rank: show on every rank, not only rank 0 (work that another rank does alone).
        console: a rich Console to draw on (default: standard error; the CLI passes its own).
        threshold_s: seconds before anything shows (default `THRESHOLD_S`; the CLI shows at once).

    Yields:
        The `Phase`, to `update` and `advance`.
    """
    global _display
    shown = Phase(description, total)
    if not enabled:
        yield shown
        return
    with _lock:
        outermost = not _stack
        if outermost:
            mode = _mode(console)
            rank = _rank()
            if rank != 0 and not every_rank:
                mode = "off"
            prefix = f"rank {rank}: " if rank != 0 else ""
        _stack.append(shown)
        if outermost and mode != "off":
            threshold = THRESHOLD_S if threshold_s is None else threshold_s
            _display = _Display(mode, threshold, prefix, console)
    try:
        yield shown
    finally:
        display = None
        with _lock:
            if outermost:
                display, _display = _display, None
            elif _display is not None and _display.bar is not None:
                _display.refresh(final=True)  # the nested part's last state is drawn once
        if display is not None:
            display.close()
        with _lock:
            if shown in _stack:  # and every phase left open inside it (a generator not closed)
                del _stack[_stack.index(shown) :]


def note(detail: str, fraction: float | None = None) -> None:
    """Tell the innermost running phase what runs now and, optionally, the share done (0 to 1):
    how solvers report, without knowing whether anyone shows it. No phase: nothing happens."""
    with _lock:
        if not _stack:
            return
        current = _stack[-1]
        current.detail = detail
        if fraction is not None:
            current.fraction = min(max(fraction, 0.0), 1.0)
    _refresh()


def each(items: Iterable[T], description: str, label: Callable[[T], str] = str) -> Iterator[T]:
    """`items`, one at a time, inside a phase that counts them and names the current one.

    Example:
        >>> for m, size in each(settings, "microbatch counts", lambda s: f"M={s[0]}"):
        ...     plan_one(m, size)
        (in a log) pdcompile: planning 1185 nodes on 4 devices: 12 s, microbatch counts 4/7: M=8
    """
    items = list(items)
    with phase(description, total=len(items)) as shown:
        for i, item in enumerate(items, 1):
            shown.update(label(item), done=i)  # `schedules 3/7: zb-h1`: the third of 7 runs
            yield item


def _visible() -> list[tuple[Phase, Phase]]:
    """The phases shown, each with the phase whose progress it shows: a nested phase whose
    description begins one it runs in (a `plan()` a search calls) adds no part of its own, but
    its progress, where it has some, is shown as that one's."""
    shown: list[tuple[Phase, Phase]] = []
    for p in _stack:
        same = next((i for i, (q, _) in enumerate(shown)
                     if q.description.startswith(p.description)), None)  # fmt: skip
        if same is None:
            shown.append((p, p))
        elif p.progress():
            shown[same] = (shown[same][0], p)
    return shown


def _refresh() -> None:
    with _lock:
        if _display is not None:
            _display.refresh()


def _mode(console: Any) -> str:
    chosen = os.environ.get(ENV, "").strip().lower()
    if chosen in ("bar", "log", "off"):
        return chosen
    if console is not None:
        return "bar" if console.is_terminal else "off"
    try:
        return "bar" if sys.stderr.isatty() else "log"
    except (AttributeError, ValueError):  # replaced or closed standard error
        return "log"


def _rank() -> int:
    """This process's rank: torch.distributed's once initialised (never imported here), else
    torchrun's `RANK`, else 0."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _elapsed(seconds: float) -> str:
    """`12 s`, `3 min 05 s`."""
    whole = int(seconds)
    return f"{whole} s" if whole < 60 else f"{whole // 60} min {whole % 60:02d} s"


class _Stderr(logging.StreamHandler):
    """Writes to the standard error of the moment (tests and tools replace `sys.stderr`)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("pdcompile: %(message)s"))

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


_fallback = _Stderr()


def _say(text: str) -> None:
    """A progress line: to the program's logging where it configured some, else to stderr."""
    if log.hasHandlers():
        log.info(text)
        return
    if _silenced():
        return
    _fallback.handle(log.makeRecord(LOGGER, logging.INFO, __file__, 0, text, (), None))


def _silenced() -> bool:
    """A level above INFO set on `pdcompile.core.progress` or `pdcompile` (the root's default
    WARNING
    does not count: it is no choice of the program's)."""
    logger: logging.Logger | None = log
    while logger is not None and logger.name != "root":
        if logger.level != logging.NOTSET:
            return logger.level > logging.INFO
        logger = logger.parent if logger.propagate else None
    return False
