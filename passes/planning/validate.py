"""Checks before anything runs: a plan's layout against its cluster or the job's ranks, its
microbatch counts, and a schedule (matched messages, complete work, no deadlock).

Torch-free. The deadlock check executes the schedule abstractly under the executor's rules:
a send never blocks (isend), a receive waits for its send, an all-reduce waits for every rank
of its group, compute waits for nothing else (its inputs are received by earlier actions).
"""

from __future__ import annotations

import numbers
from collections import Counter
from typing import TYPE_CHECKING, Any

from pdcompile.core.errors import PartitionError, ScheduleError
from pdcompile.scheduling import Action, Schedule
from pdcompile.scheduling.action_kinds import COMPUTE, RECV, SEND, kind, overlappable
from pdcompile.scheduling.base import MAX_MICROBATCHES

if TYPE_CHECKING:
    from pdcompile.passes.planning.plans import Plan


def check_num_microbatches(
    value: Any, what: str = "num_microbatches", cap: int | None = MAX_MICROBATCHES
) -> int:
    """`value` as an int from 1 to `cap` (`MAX_MICROBATCHES`, pdcompile.scheduling.base: the
    most microbatches per step a plan, a simulation or a training step runs).

    Raises:
        PartitionError: not an integer, below 1 or above `cap`, naming `what`, the value, the
            cap and the way out.
    """
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise PartitionError(f"{what} must be an integer >= 1, got {type(value).__name__} {shown}")
    if cap is not None and value > cap:
        raise PartitionError(
            f"{what}={shown} is above the cap of {cap} microbatches per step "
            "(pdcompile.scheduling.base.MAX_MICROBATCHES); use fewer, larger microbatches (a "
            "few per pipeline stage keep the pipeline full)"
        )
    return int(value)


def check_layout(plan: Plan, num_devices: int, *, world: bool = False) -> None:
    """Raise `PartitionError` unless `plan`'s stages are numbered in order, each on distinct
    ranks below `num_devices` and receiving only from earlier stages, its tie groups name two
    or more of its stages, and its microbatch count and size are in range. With `world`,
    `num_devices` is the job's world size, and every rank must run a stage: the check every
    rank makes before its first message, so that all raise the same error."""
    used = sorted({r for s in plan.stages for r in s.ranks})
    if world and len(used) != num_devices:
        raise PartitionError(
            f"the plan places its stages on {len(used)} devices but the job has {num_devices} "
            f"ranks; start as many ranks as the plan uses (torchrun --nproc_per_node "
            f"{len(used)}) or plan for cluster={num_devices}"
        )
    where = f"the job's {num_devices} ranks" if world else f"its cluster's {num_devices} devices"
    for i, stage in enumerate(plan.stages):
        ranks, sources = stage.ranks, [src for src, _ in stage.recv_bytes]
        if stage.index != i or stage.replicas < 1 or len(ranks) != stage.replicas:
            raise PartitionError(
                f"stage #{i} has index {stage.index} and {stage.replicas} replicas on ranks "
                f"{list(ranks)}; stages are numbered in order, one rank per replica, at least one"
            )
        if len(set(ranks)) < len(ranks) or not all(0 <= r < num_devices for r in ranks):
            raise PartitionError(
                f"stage {i} runs on ranks {list(ranks)}, but the plan's stages need distinct "
                f"ranks among {where} (0 to {num_devices - 1}); plan for this cluster"
            )
        if not all(0 <= src < i for src in sources) or not set(stage.no_grad_from) <= {*sources}:
            raise PartitionError(
                f"stage {i} receives from stages {sources} (no gradients back to "
                f"{list(stage.no_grad_from)}); a stage receives only from earlier stages"
            )
    for group, _ in plan.ties:
        if len(set(group)) < 2 or not all(0 <= s < plan.num_stages for s in group):
            raise PartitionError(
                f"tie group {list(group)} must name two or more of the plan's {plan.num_stages} "
                "stages; re-score the plan with pdcompile.evaluate"
            )
    check_num_microbatches(plan.num_microbatches)
    if plan.microbatch_size is not None:
        check_num_microbatches(plan.microbatch_size, "microbatch_size", cap=None)


def _message(rank: int, a: Action) -> tuple:
    """The identity of a message, the same for its send and its receive: sending and receiving
    rank, then the action's key."""
    src, dst = (rank, a.peer) if a.kind == SEND else (a.peer, rank)
    return (src, dst, *a.key)


def _fail(schedule: Schedule, why: str, mark: dict[int, int]) -> ScheduleError:
    return ScheduleError(f"invalid {schedule.kind} schedule: {why}\n{schedule.grid(mark)}")


def validate_schedule(schedule: Schedule) -> None:
    """Raise `ScheduleError` with a rank-by-step grid (`!` marks the bad step) unless every send
    has its receive, every compute item the items it needs of its microbatch before it on the
    same rank (a backward after its forward, `W` after its `I`: the action table's `needs`),
    every overlapped pair's bracket is followed by its parts (its forward, then a backward
    part), every microbatch a stage starts also ends there (a fused backward, or a `W`), each
    rank runs only its own stages, and the schedule runs to the end without deadlock."""
    sends, recvs = Counter(), Counter()
    where: dict[tuple, tuple[int, int]] = {}
    for rank, actions in schedule.actions.items():
        stages = schedule.stages_of(rank)
        done: dict[str, set[tuple[int, int]]] = {letter: set() for letter in COMPUTE}
        for i, a in enumerate(actions):
            if a.stage not in stages:
                raise _fail(schedule, f"rank {rank} runs stage {a.stage} at step {i}", {rank: i})
            row = kind(a.kind)
            if a.kind in (SEND, RECV):
                key = _message(rank, a)
                (sends if a.kind == SEND else recvs)[key] += 1
                where.setdefault(key, (rank, i))
            if row.brackets:
                _check_pair(schedule, rank, i, actions[i + 1 : i + 1 + row.brackets])
            if not row.is_compute:
                continue
            for need in row.needs:
                if (a.stage, a.microbatch) not in done[need]:
                    raise _fail(
                        schedule,
                        f"rank {rank} runs {a} before {need}{a.microbatch} (stage {a.stage})",
                        {rank: i},
                    )
            done[a.kind].add((a.stage, a.microbatch))
        started = Counter((a.stage, a.microbatch) for a in actions if kind(a.kind).starts)
        ended = Counter((a.stage, a.microbatch) for a in actions if kind(a.kind).ends)
        if schedule.training and started != ended:
            missing = sorted((started - ended) | (ended - started))
            raise _fail(schedule, f"rank {rank}: (stage, microbatch) {missing} lack F or B", {})
    for key in sorted(set(sends) | set(recvs)):
        if sends[key] != 1 or recvs[key] != 1:
            src, dst, stream, k, _, _ = key
            raise _fail(
                schedule,
                f"message {stream}{k} from rank {src} to rank {dst}: {sends[key]} sends, "
                f"{recvs[key]} receives (want one each)",
                dict([where[key]]),
            )
    _run(schedule)


def _check_pair(schedule: Schedule, rank: int, i: int, parts: tuple[Action, ...]) -> None:
    """The bracket at step `i` of `rank` is followed by `parts`: its forward, then a backward
    part (`overlappable`)."""
    bracket = schedule.actions[rank][i]
    mine = overlappable([a.kind for a in parts]) and parts[0][1:3] == bracket[1:3]
    if not mine:  # the forward's (stage, microbatch) name the bracket
        raise _fail(
            schedule,
            f"rank {rank}: the overlapped pair at step {i} must be followed by its forward "
            f"(F{bracket.microbatch}, stage {bracket.stage}) and a backward part, got "
            f"{[str(a) for a in parts]}",
            {rank: i},
        )


def _run(schedule: Schedule) -> None:
    """Execute abstractly; raise with every rank's blocked step if no rank can move."""
    position = dict.fromkeys(schedule.actions, 0)
    sent: set[tuple] = set()
    arrived: dict[tuple, set[int]] = {}
    released: set[tuple] = set()
    while True:
        moved = False
        for rank, actions in schedule.actions.items():
            while position[rank] < len(actions):
                a = actions[position[rank]]
                if a.kind == RECV and _message(rank, a) not in sent:
                    break
                if a.is_collective:
                    key = a.collective
                    arrived.setdefault(key, set()).add(rank)
                    if arrived[key] == set(a.group):
                        released.add(key)
                    if key not in released:
                        break
                if a.kind == SEND:
                    sent.add(_message(rank, a))
                position[rank] += 1
                moved = True
        if all(position[r] == len(a) for r, a in schedule.actions.items()):
            return
        if not moved:
            blocked = {r: p for r, p in position.items() if p < len(schedule.actions[r])}
            waits = ", ".join(f"rank {r} at {schedule.actions[r][p]}" for r, p in blocked.items())
            raise _fail(schedule, f"deadlock: {waits}", blocked)
