"""Progress of a long command: `pdcompile.core.progress` shown at once, on the CLI's console.

A spinner with the elapsed time says what runs; where the work says how far it is (such as each
round of the `dp` solver's bisection, `pdcompile.core.progress.note`), a bar and its message follow
it. On a terminal the display goes when the work ends; elsewhere (standard error a pipe or a
file) the work's own progress lines appear after `pdcompile.core.progress.THRESHOLD_S`, and nothing
is drawn on a `console` that is no terminal.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

from pdcompile.core.progress import phase


@contextmanager
def progress(description: str, console: Console | None = None) -> Iterator[None]:
    """Show `description`, the elapsed time and, once the work reports it, how far it is, on
    `console` (default: standard error) while the `with` block runs.

    Example:
        >>> with progress("planning 20000 nodes for 4 devices (dp)"):
        ...     result = plan(costs, "4")
    """
    terminal = (console or Console(stderr=True)).is_terminal
    with phase(description, console=console, threshold_s=0.0 if terminal else None):
        yield
