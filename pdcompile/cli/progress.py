"""Progress of a long command on standard error, drawn with rich while it runs.

A spinner with the elapsed time says what runs; where the work says how far it is (a log
record of a `pdcompile` logger carrying `progress`, a fraction from 0 to 1, such as each round
of the `dp` solver's bisection), a bar and its message follow it. Nothing is drawn where
standard error is not a terminal, and the display goes when the work ends.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)

LOGGER = "pdcompile"  # the loggers whose records with `progress` move the bar


class _Follow(logging.Handler):
    """Moves a task of `bar` to the fraction each record's `progress` gives."""

    def __init__(self, bar: Progress, task: TaskID, description: str) -> None:
        super().__init__(logging.INFO)
        self.bar, self.task, self.description = bar, task, description

    def emit(self, record: logging.LogRecord) -> None:
        fraction = getattr(record, "progress", None)
        if fraction is not None:
            text = f"{self.description}: {record.getMessage()}"
            self.bar.update(self.task, description=text, total=1.0, completed=fraction)


@contextmanager
def progress(description: str, console: Console | None = None) -> Iterator[None]:
    """Show `description`, the elapsed time and, once the work reports it, how far it is, on
    `console` (default: standard error) while the `with` block runs.

    Example:
        >>> with progress("planning 20000 nodes for 4 devices (dp)"):
        ...     result = plan(costs, "4")
    """
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               TaskProgressColumn(), TimeElapsedColumn())  # fmt: skip
    logger = logging.getLogger(LOGGER)
    level = logger.level
    with Progress(*columns, console=console, transient=True) as bar:
        handler = _Follow(bar, bar.add_task(description, total=None), description)
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
