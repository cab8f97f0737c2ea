"""torch.distributed.pipelining's schedule CSV, in and out: `from_torch_csv`, `to_torch_csv`.
Torch-free (the format is parsed here, as torch's `_Action.from_str` reads it).

The file has one row per rank and one action per cell, in order: `0F1` is stage 0's forward of
microbatch 1, `B`, `I`, `W` its fused backward, input and weight parts (pdcompile's kinds of the
same letters), `(0F3;1B0)OVERLAP_F_B` a forward and a backward run as one (pdcompile's `FB`
bracket, `action_kinds.overlapped`; sub-actions that are no forward-then-backward pair are
expanded in their order). Empty cells (torch's idle steps) are skipped. Read as orders:

- sends and receives (`SEND_F`, `RECV_F`, `SEND_B`, `RECV_B`: torch's `compute_comms` format)
  are ignored: pdcompile's builder derives every message from the compute orders;
- `REDUCE_GRAD`, `UNSHARD`, `RESHARD` are ignored: pdcompile places its own gradient
  all-reduces and update after a stage's last backward, and keeps every stage's parameters
  whole on its rank (torch's FSDP unsharding has no counterpart).

A loaded file is a `TorchCsvSchedule`: a kind with fixed orders, which runs exactly the file's
stages (on the ranks it shows them on, one replica each), ranks and microbatch count. It is
registered under a name (`csv:<file stem>` by default), since a plan stores its schedule's name
(`Plan.rules` looks it up): plans of it resolve on every process that loaded the file, and a
process that did not (another rank, a later session) loads it again before reading such a plan.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from pdcompile.core.errors import ScheduleError
from pdcompile.core.regular_file import read_regular_text
from pdcompile.scheduling.action_kinds import (
    SPLIT,
    B,
    F,
    I,
    W,
    is_compute,
    kind,
    overlappable,
    overlapped,
)
from pdcompile.scheduling.actions import Schedule
from pdcompile.scheduling.base import PipelineSchedule
from pdcompile.scheduling.builder import build_schedule
from pdcompile.scheduling.placement import Item, Placement
from pdcompile.scheduling.registry import SCHEDULES, get_schedule

__all__ = ["TorchCsvSchedule", "from_torch_csv", "to_torch_csv"]

_ACTION = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
IGNORED = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE_GRAD", "UNSHARD", "RESHARD")
_LETTERS = (F, B, I, W)  # torch's compute letters, pdcompile's too
_TORCH_OVERLAP = "OVERLAP_F_B"


class TorchCsvSchedule(PipelineSchedule):
    """A torch pipelining schedule CSV's per-rank compute orders (fixed stages, ranks,
    microbatches)."""

    meaning = (
        "synchronous (a torch.distributed.pipelining schedule CSV): every rank's compute in the "
        "file's order; every stage updates once per step from all microbatches: exactly "
        "single-process gradient accumulation."
    )

    def __init__(
        self, orders: Mapping[int, Sequence[Item]] | None = None, source: str = ""
    ) -> None:
        self.source = source or "a torch schedule CSV"
        self.orders = {r: tuple(items) for r, items in sorted((orders or {}).items())}
        self.stage_rank = _stage_ranks(self.orders, self.source)
        self.num_microbatches = _microbatches(self.orders, len(self.stage_rank), self.source)
        splits = any(k in (I, W) for items in self.orders.values() for k, _, _ in items)
        self.items_per_microbatch = len(SPLIT) if splits else 2
        ranks = max(len(self.orders), 1)
        self.default_chunks = max(len(self.stage_rank) // ranks, 1)

    @property
    def fixes(self) -> str:
        """What the file fixes, for the errors."""
        placed = ", ".join(f"{s}->{r}" for s, r in enumerate(self.stage_rank))
        return (
            f"{self.source} fixes {len(self.stage_rank)} stages on {len(self.orders)} ranks "
            f"(stage->rank {placed}), one replica each, and {self.num_microbatches} microbatches"
        )

    def check(
        self, replicas: Sequence[int], num_microbatches: int, ties: Sequence[Sequence[int]] = ()
    ) -> None:
        """One replica a stage and the file's microbatch count (the planner asks stage by
        stage: the stage count is `check_layout`'s)."""
        super().check(replicas, num_microbatches, ties)
        if any(r != 1 for r in replicas) or num_microbatches != self.num_microbatches:
            raise ScheduleError(
                f"{self.name or 'this schedule'}: {self.fixes}; got stages with replicas "
                f"{list(replicas)} and {num_microbatches} microbatches"
            )

    def check_layout(self, ranks: Sequence[Sequence[int]], num_microbatches: int) -> None:
        if [tuple(r) for r in ranks] != [(r,) for r in self.stage_rank]:
            raise ScheduleError(
                f"{self.name or 'this schedule'}: {self.fixes}; got stages on ranks "
                f"{[list(r) for r in ranks]}"
            )

    def chunk_rank(self, stage: int, num_ranks: int, chunks: int) -> int:
        """The file's rank of `stage` (on its ranks and stages per rank only)."""
        if num_ranks != len(self.orders) or num_ranks * chunks != len(self.stage_rank):
            raise ScheduleError(
                f"{self.name or 'this schedule'}: {self.fixes}; got {chunks} stages per rank on "
                f"{num_ranks} ranks"
            )
        return self.stage_rank[stage]

    def rank_orders(self, placement: Placement) -> Mapping[int, Sequence[Item]]:
        self.check(placement.replicas, placement.num_microbatches)
        self.check_layout(placement.ranks, placement.num_microbatches)
        return self.orders


def from_torch_csv(path: str | Path, name: str | None = None) -> TorchCsvSchedule:
    """The schedule a torch pipelining CSV holds (`_dump_csv`'s format, compute only or with
    comms), registered as `name` (default `csv:<file stem>`; a name registered again is
    replaced).

    Raises:
        ScheduleError: the file is no such CSV, or its orders are no complete schedule (every
            microbatch of every stage forward and backward once, each stage on one rank).
    """
    path = Path(path)
    source = f"torch schedule CSV {str(path)!r}"
    try:
        rows = list(csv.reader(io.StringIO(read_regular_text(path), newline="")))
    except (OSError, UnicodeDecodeError) as exc:
        raise ScheduleError(f"cannot read {source}: {exc}") from None
    orders = {rank: _row_items(row, rank, source) for rank, row in enumerate(rows)}
    rules = TorchCsvSchedule(orders, source)
    rules.name = name or f"csv:{path.stem}"
    SCHEDULES.add(rules.name, rules)
    return rules


def to_torch_csv(
    schedule: Schedule | PipelineSchedule | str, path: str | Path,
    ranks: Sequence[Sequence[int]] | None = None, num_microbatches: int | None = None,
) -> Path:  # fmt: skip
    """Write a synchronous schedule's per-rank compute orders as torch's compute-only CSV
    (what `PipelineScheduleMulti._load_csv` reads): a built `Schedule` (`build_schedule`), or
    a kind (a name or a `PipelineSchedule`) with its layout, `ranks` per stage (one each) and
    `num_microbatches` (stages in a chain). Returns `path`.

    Raises:
        ScheduleError: an asynchronous kind (torch's schedules update once per step), a stage
            with several replicas (torch has none), or a kind without its layout.
    """
    built = _built(schedule, ranks, num_microbatches)
    if any(r != 1 for r in built.replicas):
        raise ScheduleError(
            f"torch's schedule CSV places each stage on one rank; this {built.kind} schedule has "
            f"replicas {list(built.replicas)}"
        )
    rows = [_cells(built, rank) for rank in range(max(built.actions) + 1)]
    path = Path(path)
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    return path


# -- reading --------------------------------------------------------------------------------


def _row_items(row: Sequence[str], rank: int, source: str) -> list[Item]:
    """One rank's compute items, in order (docs in the module)."""
    items: list[Item] = []
    for step, cell in enumerate(row):
        text = cell.strip()
        if not text:
            continue
        where = f"{source}, rank {rank}, step {step}"
        nested = _OVERLAP.fullmatch(text)
        if nested:
            parts = [_action(p.strip(), where) for p in nested.group(1).split(";") if p.strip()]
            items += _overlap([p for p in parts if p], where)
            continue
        action = _action(text, where)
        if action:
            items.append(action)
    return items


def _action(text: str, where: str) -> Item | None:
    """A compute cell's item; None for an ignored action."""
    match = _ACTION.fullmatch(text)
    if not match:
        raise ScheduleError(
            f"{where}: {text!r} is no torch action (stage, type, microbatch: e.g. 2F0, or "
            f"(0F1;1B0){_TORCH_OVERLAP})"
        )
    stage, letter, microbatch = match.groups()
    if letter in IGNORED:
        return None
    if not microbatch:
        raise ScheduleError(f"{where}: compute action {text!r} names no microbatch")
    return (letter, int(stage), int(microbatch))


def _overlap(parts: list[Item], where: str) -> list[Item]:
    """An `OVERLAP_F_B`'s items: a bracketed pair, or its sub-actions in order."""
    if overlappable([k for k, _, _ in parts]):
        (_, *forward), (part, *backward) = parts
        return overlapped(tuple(forward), tuple(backward), part)  # type: ignore[arg-type]
    if not parts:
        raise ScheduleError(f"{where}: an {_TORCH_OVERLAP} with no compute sub-actions")
    return parts


def _stage_ranks(orders: Mapping[int, Sequence[Item]], source: str) -> tuple[int, ...]:
    """Per stage, the one rank computing it."""
    on: dict[int, set[int]] = {}
    for rank, items in orders.items():
        if not any(is_compute(k) for k, _, _ in items):
            raise ScheduleError(f"{source}: rank {rank} (row {rank + 1}) computes nothing")
        for _, stage, _ in items:
            on.setdefault(stage, set()).add(rank)
    stages = sorted(on)
    if stages != list(range(len(stages))):
        raise ScheduleError(f"{source}: stages {stages} are not 0 to {len(stages) - 1}")
    shared = {s: sorted(r) for s, r in on.items() if len(r) > 1}
    if shared:
        raise ScheduleError(f"{source}: stages on several ranks (stage: ranks) {shared}")
    return tuple(next(iter(on[s])) for s in stages)


def _microbatches(orders: Mapping[int, Sequence[Item]], stages: int, source: str) -> int:
    """The microbatch count: every stage runs each of 0 to M - 1 forward once and backward
    once (fused, or split into I and W)."""
    runs: dict[tuple[int, int], list[str]] = {}
    for items in orders.values():
        for letter, stage, microbatch in items:
            if is_compute(letter):
                runs.setdefault((stage, microbatch), []).append(letter)
    m = 1 + max((k for _, k in runs), default=-1)
    for stage in range(stages):
        for k in range(m):
            letters = sorted(runs.get((stage, k), []))
            if letters not in (sorted((F, B)), sorted(SPLIT)):
                raise ScheduleError(
                    f"{source}: stage {stage} microbatch {k} runs {letters or 'nothing'}; each "
                    f"of microbatches 0 to {m - 1} needs F and B (or I and W) once at every stage"
                )
    return m


# -- writing --------------------------------------------------------------------------------


def _built(
    schedule: Schedule | PipelineSchedule | str, ranks: Sequence[Sequence[int]] | None,
    num_microbatches: int | None,
) -> Schedule:  # fmt: skip
    """A built schedule, refused unless synchronous."""
    if isinstance(schedule, Schedule):
        name = schedule.kind
        rules = get_schedule(name) if name in SCHEDULES else None
    else:
        rules = get_schedule(schedule)
        name = rules.name or type(rules).__name__
    if rules is not None and not rules.synchronous:
        raise ScheduleError(
            f"{name} is asynchronous (updates of several minibatches overlap); torch's schedule "
            "CSV holds one synchronous step: export a synchronous kind"
        )
    if isinstance(schedule, Schedule):
        return schedule
    if ranks is None or num_microbatches is None:
        raise ScheduleError(
            f"to_torch_csv({name}): give the layout, ranks (per stage) and num_microbatches, or "
            "a built Schedule (build_schedule)"
        )
    chain = {(s, s + 1): True for s in range(len(ranks) - 1)}
    assert rules is not None
    return build_schedule(rules, ranks, chain, num_microbatches)


def _cells(built: Schedule, rank: int) -> list[str]:
    """`rank`'s compute actions as torch's cells (an `FB` bracket and its parts as one)."""
    cells: list[str] = []
    pending: list[str] = []  # an open bracket's parts
    wanted = 0
    for action in built.actions.get(rank, ()):
        if kind(action.kind).brackets:
            wanted = kind(action.kind).brackets
        elif action.kind in _LETTERS:
            cell = f"{action.stage}{action.kind}{action.microbatch}"
            if wanted:
                pending.append(cell)
                if len(pending) == wanted:
                    cells.append(f"({';'.join(pending)}){_TORCH_OVERLAP}")
                    pending, wanted = [], 0
            else:
                cells.append(cell)
    return cells
