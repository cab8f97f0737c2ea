"""Check a schedule before anything runs: matched messages, complete work, no deadlock.

Torch-free. The deadlock check executes the schedule abstractly under the executor's rules:
a send never blocks (isend), a receive waits for its send, an all-reduce waits for every rank
of its group, compute waits for nothing else (its inputs are received by earlier actions).
"""

from __future__ import annotations

from collections import Counter

from pdcompile.errors import ScheduleError
from pdcompile.schedules import Action, Schedule


def _message(rank: int, a: Action) -> tuple:
    """The identity of a message, the same for its send and its receive: sending and receiving
    rank, then the action's key."""
    src, dst = (rank, a.peer) if a.kind == "send" else (a.peer, rank)
    return (src, dst, *a.key)


def _fail(schedule: Schedule, why: str, mark: dict[int, int]) -> ScheduleError:
    return ScheduleError(f"invalid {schedule.kind} schedule: {why}\n{schedule.grid(mark)}")


def validate_schedule(schedule: Schedule) -> None:
    """Raise `ScheduleError` with a rank-by-step grid (`!` marks the bad step) unless every send
    has its receive, every forward its backward after it on the same rank (fused, or `I` then
    `W`), each rank runs only its own stages, and the schedule runs to the end without
    deadlock."""
    sends, recvs = Counter(), Counter()
    where: dict[tuple, tuple[int, int]] = {}
    for rank, actions in schedule.actions.items():
        stages = schedule.stages_of(rank)
        done: dict[str, set[tuple[int, int]]] = {"F": set(), "I": set()}
        for i, a in enumerate(actions):
            if a.stage not in stages:
                raise _fail(schedule, f"rank {rank} runs stage {a.stage} at step {i}", {rank: i})
            if a.kind in ("send", "recv"):
                key = _message(rank, a)
                (sends if a.kind == "send" else recvs)[key] += 1
                where.setdefault(key, (rank, i))
            elif a.kind in ("F", "I"):
                done[a.kind].add((a.stage, a.microbatch))
            if a.kind in ("B", "I", "W") and (a.stage, a.microbatch) not in done["F"]:
                raise _fail(
                    schedule,
                    f"rank {rank} runs {a} before F{a.microbatch} (stage {a.stage})",
                    {rank: i},
                )
            if a.kind == "W" and (a.stage, a.microbatch) not in done["I"]:
                raise _fail(
                    schedule,
                    f"rank {rank} runs {a} before I{a.microbatch} (stage {a.stage})",
                    {rank: i},
                )
        forwards = Counter((a.stage, a.microbatch) for a in actions if a.kind == "F")
        backwards = Counter((a.stage, a.microbatch) for a in actions if a.kind in ("B", "W"))
        if schedule.training and forwards != backwards:
            missing = sorted((forwards - backwards) | (backwards - forwards))
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
                if a.kind == "recv" and _message(rank, a) not in sent:
                    break
                if a.is_collective:
                    key = a.collective
                    arrived.setdefault(key, set()).add(rank)
                    if arrived[key] == set(a.group):
                        released.add(key)
                    if key not in released:
                        break
                if a.kind == "send":
                    sent.add(_message(rank, a))
                position[rank] += 1
                moved = True
        if all(position[r] == len(a) for r, a in schedule.actions.items()):
            return
        if not moved:
            blocked = {r: p for r, p in position.items() if p < len(schedule.actions[r])}
            waits = ", ".join(f"rank {r} at {schedule.actions[r][p]}" for r, p in blocked.items())
            raise _fail(schedule, f"deadlock: {waits}", blocked)
