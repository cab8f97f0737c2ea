"""Timelines: the start and end of every action on every rank, measured or simulated. Torch-free.

One format for both, so a measured run and its simulation render with the same code. Times are
seconds from an arbitrary origin (`perf_counter` for measured runs, 0 for a simulation); the
Chrome-trace JSON (`to_chrome_trace`) has microsecond timestamps and opens in Perfetto.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from pdcompile.core.errors import ScheduleError
from pdcompile.core.regular_file import read_regular_text

FORMAT = "pdcompile.timeline"


class Event(NamedTuple):
    """One action of one rank: `kind` and `microbatch` as in `Action` (-1 for per-step
    actions), `peer` the other rank of a `send`/`recv` (-1 otherwise). A named tuple: the
    simulator makes hundreds of thousands."""

    rank: int
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    peer: int = -1

    @property
    def duration(self) -> float:
        return self.end - self.start


def shifted(events: Iterable[Event]) -> list[Event]:
    """`events` with times moved so that the earliest start is 0."""
    events = list(events)
    origin = min((e.start for e in events), default=0.0)
    return [
        Event(e.rank, e.kind, e.stage, e.microbatch, e.start - origin, e.end - origin, e.peer)
        for e in events
    ]


def to_chrome_trace(
    events: Sequence[Event], path: str | Path | None = None, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The Chrome trace-event JSON of `events` (one track per rank; `ph: X` complete events,
    microseconds); written to `path` when given. `args` keeps every field, so `load_trace`
    reads it back exactly; `meta` (JSON-native, e.g. the plan that ran: `trace_meta`) goes in
    `otherData`."""
    trace_events: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        trace_events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
             "args": {"name": f"rank {rank}"}}
        )  # fmt: skip
    for e in shifted(events):
        name = e.kind if e.microbatch < 0 else f"{e.kind}{e.microbatch}"
        trace_events.append({
            "name": name, "cat": e.kind, "ph": "X", "pid": 0, "tid": e.rank,
            "ts": e.start * 1e6, "dur": e.duration * 1e6, "args": e._asdict(),
        })  # fmt: skip
    other = {**(meta or {}), "format": FORMAT}
    trace = {"traceEvents": trace_events, "displayTimeUnit": "ms", "otherData": other}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


def trace_meta(path: str | Path) -> dict[str, Any]:
    """The `meta` a trace was written with (`to_chrome_trace`; {} without).

    Raises:
        ScheduleError: as `load_trace`.
    """
    load_trace(path)  # says what is wrong with the file, if anything
    other = json.loads(read_regular_text(path))["otherData"]
    return {k: v for k, v in other.items() if k != "format"}


def load_trace(path: str | Path) -> list[Event]:
    """The events of a trace written by `to_chrome_trace`.

    Raises:
        ScheduleError: the file is missing, not JSON or not a pdcompile timeline (says where).
    """
    try:
        data = json.loads(read_regular_text(path))
        if data.get("otherData", {}).get("format") != FORMAT:
            raise ValueError("no pdcompile.timeline format marker")
        return [
            Event(**{k: e["args"][k] for k in Event._fields})
            for e in data["traceEvents"]
            if e.get("ph") == "X"
        ]
    except OSError as e:
        raise ScheduleError(f"cannot read trace {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ScheduleError(
            f"{path}: not a pdcompile timeline trace ({e}); write traces with to_chrome_trace"
        ) from None
