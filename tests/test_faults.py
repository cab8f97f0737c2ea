"""The fault-injection tier (issue 31; marker `faults`, run by .ci/run): on 3 spawned gloo ranks
meeting through a `TCPStore` in rank 0's process (pdcompile without torchrun), one rank is
stopped (SIGSTOP: a hang, or a host cut off) or killed (SIGKILL) at a point of a job that
checkpoints itself after every step (tests/fault_relaunch.py), and every other rank must end with
a `PdcompileError` naming it ("another rank" where the backend cannot tell) within the timeout
plus `MARGIN_S`. The points: start-up (the fingerprints), the loaded profile, the executor's
process groups and a step (before step 3, after two checkpoints), for rank 0, the middle and the
last rank, both signals; for each rank with one signal: the automatic resume's listing and its
load (the job starting from a complete checkpoint at step 2), the re-plan (its decision after
step 2) and a save (inside the automatic save of step 2: a middle or last rank once its files
are written, before they are hashed; rank 0 once the manifest is written, before its rename).

Then the checkpoints: the newest that was complete when the fault struck is still there and
verifies, and no folder under a checkpoint's name fails to verify (a torn save). And the
relaunch: the same job on 3 fresh ranks, same folder, no fault, trained to `STEPS`: it must
resume from the newest complete checkpoint (none skipped as damaged; from scratch when there is
none), on the plan that checkpoint recorded, and end bit-equal (every parameter, buffer and
momentum buffer, `torch.equal`) to an uninterrupted run of the same job (1f1b). The re-plan's
jobs move (to 1 stage x 3 replicas) after step 2, so their uninterrupted run is one that moves
too; their relaunch stops after step 3 and is compiled once more, which must resume on the plan
the job moved to.

The table of cases, error classes, seconds and relaunch outcomes is written to
`$PDCOMPILE_FAULT_TABLE` when set (docs/errors.md gives one); `PDCOMPILE_FAULT_CASES=save,load`
runs the cases of those points only.

    python -m pytest tests/test_faults.py -m faults
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from fault_relaunch import (
    FAULT_STEP,
    STARTUP_S,
    STEPS,
    WORLD,
    batch,
    complete,
    differences,
    join,
    model,
    options,
    planned,
    relaunched,
    torn,
)
from spawn import RankFailed, RankOutcome, free_port, run_ranks

import pdcompile
from pdcompile import CostGraph, Plan
from pdcompile.runtime.auto_resume import checkpoint_name

pytestmark = pytest.mark.faults

MARGIN_S = 15.0  # a loaded machine, beyond the timeout
SPAWN_S = 4 * STARTUP_S + 120  # a spawned group's hard limit
PARALLEL = 4  # spawned groups at once (most of a case is waiting)
CORE = ["start-up", "profile", "groups", "step"]
MORE = ["resume listing", "re-plan", "save", "load"]
SEEDED = ("resume listing", "load")  # their jobs start from the uninterrupted run's step 2
CASES = [(p, v, s) for p in CORE for v in range(WORLD) for s in ("STOP", "KILL")] + [
    (p, v, ("STOP", "KILL")[(i + v) % 2]) for i, p in enumerate(MORE) for v in range(WORLD)
]


def _fault(sig: str, stamp: str, auto: str) -> None:
    """Note the time and the newest complete checkpoint, then stop or kill this process."""
    newest = complete(auto)[:1]
    with open(stamp, "w") as f:
        json.dump({"time": time.time(), "complete": newest[0] if newest else None}, f)
    os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
    time.sleep(3600)


def _inject(point: str, sig: str, stamp: str, auto: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this rank fault on entering `point` (the step's is the job's loop)."""
    import pdcompile.compiling.analysis as analysis
    import pdcompile.compiling.steps as steps
    from pdcompile.closed_loop.move import Replanner
    from pdcompile.compiling.pipelined_module import PipelinedModule
    from pdcompile.runtime import manifest
    from pdcompile.runtime.auto_resume import AutoCheckpoint
    from pdcompile.runtime.distributed import DistributedComm
    from pdcompile.runtime.profile_load import ProfileLoad

    def faulting(owner: object, name: str, when: str = "") -> None:
        """`owner.name` faults (when its first argument's name holds `when`)."""
        original = getattr(owner, name)

        def replaced(*args: object, **kwargs: object) -> object:
            if not when or when in os.path.basename(str(args[0])):
                _fault(sig, stamp, auto)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, replaced)

    rank0 = os.environ["RANK"] == "0"
    saving = f".{checkpoint_name(FAULT_STEP)}.tmp-"  # the staging folder of step 2's save
    where = {
        "start-up": (steps, "fingerprint"),
        "profile": (analysis, "analyze") if rank0 else (ProfileLoad, "serve"),
        "groups": (DistributedComm, "__init__"),
        "resume listing": (AutoCheckpoint, "_agreed"),
        "load": (PipelinedModule, "load"),
        "re-plan": (Replanner, "run"),
        "save": (manifest, "commit", saving) if rank0 else (manifest, "hashes", saving),
    }
    if point in where:
        faulting(*where[point])


def _faulted(
    rank: int,
    world_size: int,
    init_file: str,
    case: tuple[str, int, str],
    port: int,
    planned: tuple[CostGraph, Plan],
    folder: str,
) -> tuple[str, bool, str, float]:
    """One case on this rank: (error class, whether a PdcompileError, message, seconds from the
    fault to the error)."""
    from pdcompile.core.errors import PdcompileError

    (point, victim, sig), (costs, plan) = case, planned
    join(rank, world_size, port)
    auto, stamp = os.path.join(folder, "auto"), os.path.join(folder, "fault.json")
    with pytest.MonkeyPatch.context() as monkeypatch:
        if rank == victim:
            _inject(point, sig, stamp, auto, monkeypatch)
        try:
            net, x, _ = model()
            module = pdcompile.compile(net, (x,), **options(auto, point, costs, plan))
            for step in range(module.steps, STEPS):
                if rank == victim and point == "step" and step == FAULT_STEP:
                    _fault(sig, stamp, auto)
                module.train_step(*batch(step))
        except Exception as exc:
            faulted = json.load(open(stamp))["time"] if os.path.exists(stamp) else float("nan")
            seconds = time.time() - faulted
            return type(exc).__name__, isinstance(exc, PdcompileError), str(exc), seconds
    return "none", False, "", float("nan")


def _spawn(fn, *args: object, awaited: list[int]) -> list[RankOutcome]:
    """`fn` on `WORLD` fresh ranks (a free port each time), the `awaited` ones' outcomes; a rank
    that never ended is "hung"."""
    try:
        outcomes = run_ranks(fn, WORLD, *args, timeout_s=SPAWN_S, allow_failures=True,
                             wait_for=awaited)  # fmt: skip
    except RankFailed as exc:
        outcomes = {r: RankOutcome(r, error="hung", message=str(exc)) for r in awaited}
    return [outcomes[r] for r in awaited]


@dataclass
class Row:
    """A case's outcome: the survivors', what its folder held, and its relaunch."""

    case: tuple[str, int, str]
    survivors: list[RankOutcome]
    seconds: float = 0.0
    resumed: str = "-"  # what the relaunch resumed from
    equal: str = "-"  # "bit-equal", or what differs
    newest: list[int] = field(default_factory=list)  # the newest complete checkpoint, after
    left: list[str] = field(default_factory=list)  # what the faulted save left (hidden names)
    problems: list[str] = field(default_factory=list)  # the checkpoints' and the relaunch's


def _uninterrupted(root: str, planned: tuple[CostGraph, Plan], point: str) -> list[dict]:
    """The job of `point`'s cases without a fault, by rank (its checkpoints in root/<point>)."""
    auto = os.path.join(root, f"uninterrupted-{point}", "auto")
    outcomes = _spawn(relaunched, point, free_port(), planned, auto, None,
                      awaited=list(range(WORLD)))  # fmt: skip
    failed = [f"rank {o.rank}: {o.error}: {o.message}\n{o.traceback}" for o in outcomes if not o.ok]
    assert not failed, f"the uninterrupted run ({point}) failed:\n" + "\n".join(failed)
    return [o.value for o in outcomes]


def _run(case, planned, root: str, references: dict[str, list[dict]]) -> Row:
    point, victim, sig = case
    start = time.monotonic()
    folder = os.path.join(root, f"{point}-{victim}-{sig}".replace(" ", "_"))
    auto = os.path.join(folder, "auto")
    os.makedirs(auto)
    if point in SEEDED:
        name = checkpoint_name(FAULT_STEP)
        shutil.copytree(os.path.join(root, "uninterrupted-step", "auto", name),
                        os.path.join(auto, name))  # fmt: skip
    survivors = [r for r in range(WORLD) if r != victim]
    row = Row(case, _spawn(_faulted, case, free_port(), planned, folder, awaited=survivors))
    faulted_s = time.monotonic() - start
    _check_folder(row, folder)
    relaunch = _spawn(relaunched, point, free_port(), planned, auto,
                      STEPS - 1 if point == "re-plan" else None,
                      awaited=list(range(WORLD)))  # fmt: skip
    _check_relaunch(row, relaunch, references["re-plan" if point == "re-plan" else "step"])
    if left := sorted(n for n in os.listdir(auto) if n.startswith(".")):
        row.problems.append(f"after the relaunch, what killed saves left is still there: {left}")
    row.seconds = time.monotonic() - start
    print(f"{point}, SIG{sig} of rank {victim}: {row.seconds:.0f} s (the faulted job "
          f"{faulted_s:.0f} s, leaving {row.left}); relaunch from {row.resumed}: {row.equal}",
          flush=True)  # fmt: skip
    return row


def _check_folder(row: Row, folder: str) -> None:
    """After the survivors ended: the newest checkpoint complete at the fault is still complete,
    and none under a checkpoint's name is torn."""
    stamp, auto = os.path.join(folder, "fault.json"), os.path.join(folder, "auto")
    if not os.path.exists(stamp):
        row.problems.append("the fault never struck (no stamp)")
        return
    newest = json.load(open(stamp))["complete"]
    if newest is not None and newest not in complete(auto):
        row.problems.append(f"{checkpoint_name(newest)}, complete when the fault struck, is lost "
                            f"or damaged: {os.listdir(auto)}")  # fmt: skip
    row.problems += [f"torn checkpoint left: {t}" for t in torn(auto)]
    row.newest = complete(auto)[:1]
    row.left = sorted(n for n in os.listdir(auto) if n.startswith("."))
    staged = f".{checkpoint_name(FAULT_STEP)}.tmp-"
    whole = [n for n in row.left if n.startswith(staged) and "manifest.json" in _files(auto, n)]
    if row.case[:2] == ("save", 0) and not whole:  # stopped before its rename: all but listed
        row.problems.append(f"the save fault left no uncommitted save of step 2: {row.left}")


def _files(auto: str, name: str) -> list[str]:
    path = os.path.join(auto, name)
    return os.listdir(path) if os.path.isdir(path) else []


def _check_relaunch(row: Row, relaunch: list[RankOutcome], reference: list[dict]) -> None:
    """The relaunch resumed from the newest complete checkpoint, on its plan, and ends bit-equal
    to the uninterrupted run, rank by rank."""
    failed = [o for o in relaunch if not o.ok]
    if failed:
        row.resumed, row.equal = "failed", "-"
        row.problems += [f"relaunch rank {o.rank}: {o.error}: {o.message[:400]}" for o in failed]
        return
    newest = row.newest[0] if row.newest else None
    expected = None if newest is None else checkpoint_name(newest)
    unequal = []
    for o in relaunch:
        first, where = o.value["starts"][0], f"relaunch rank {o.rank}"
        got = None if first["from"] is None else os.path.basename(first["from"])
        if got != expected or first["skipped"]:
            row.problems.append(f"{where} resumed from {got} (skipping {first['skipped']}), not "
                                f"the newest complete checkpoint {expected}")  # fmt: skip
        for start in o.value["starts"]:
            if start["from"] is not None and not start["recorded a plan"]:
                row.problems.append(f"{where}: {start['from']} records no plan")
            elif not start["on its plan"]:
                row.problems.append(f"{where} resumed from {start['from']} on another plan than "
                                    "the one it recorded")  # fmt: skip
        if o.value["steps"] != STEPS:
            row.problems.append(f"{where} ended after {o.value['steps']} steps, not {STEPS}")
        if diff := differences(o.value, reference[o.rank]):
            unequal.append(o.rank)
            row.problems += [f"{where}: {d}" for d in diff]
    starts = relaunch[0].value["starts"]
    row.resumed = " then ".join(
        "scratch" if s["from"] is None else os.path.basename(s["from"]) for s in starts
    )
    row.equal = "bit-equal" if not unequal else f"differs on ranks {unequal}"


def _table(rows: list[Row]) -> str:
    lines = ["| case | survivor | error | seconds to the error | names | relaunch: resumed from "
             "| relaunch vs uninterrupted |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        point, victim, sig = row.case
        tail = f"{row.resumed} | {row.equal} |"
        for o in row.survivors:
            if not o.ok:
                lines.append(f"| {point}, SIG{sig} rank {victim} | rank {o.rank} | {o.error}: "
                             f"{o.message[:60]} | - | - | {tail}")  # fmt: skip
                continue
            error, _, message, seconds = o.value
            blamed = message.replace(f"rank {o.rank} gave up", "")
            names = f"rank {victim}" if f"rank {victim}" in blamed else "another rank"
            if f"rank {victim}" not in blamed and "another rank" not in blamed:
                names = "wrong"
            lines.append(f"| {point}, SIG{sig} rank {victim} | rank {o.rank} | {error} | "
                         f"{seconds:.1f} | {names} | {tail}")  # fmt: skip
    return "\n".join(lines)


@pytest.mark.timeout(1800)
def test_every_survivor_of_a_stopped_or_killed_rank_ends_with_a_named_error(tmp_path) -> None:
    chosen = os.environ.get("PDCOMPILE_FAULT_CASES", "")  # e.g. "save": the cases of a point
    cases = [c for c in CASES if not chosen or c[0] in chosen.split(",")]
    costs_plan, root = planned(), str(tmp_path)
    kinds = ["step"] + (["re-plan"] if any(c[0] == "re-plan" for c in cases) else [])
    with ThreadPoolExecutor(PARALLEL) as pool:
        runs = pool.map(lambda kind: _uninterrupted(root, costs_plan, kind), kinds)
        references = dict(zip(kinds, runs, strict=True))
        rows = list(pool.map(lambda case: _run(case, costs_plan, root, references), cases))
    moved = {k: [r["moved"] for r in runs] for k, runs in references.items()}
    assert moved["step"] == [None] * WORLD, moved  # no re-planner
    assert moved.get("re-plan", [FAULT_STEP] * WORLD) == [FAULT_STEP] * WORLD, moved
    table = _table(rows)
    if os.environ.get("PDCOMPILE_FAULT_TABLE"):
        with open(os.environ["PDCOMPILE_FAULT_TABLE"], "w") as f:
            f.write(table + "\n")
    print(table)
    bad = []
    for row in rows:
        point, victim, sig = row.case
        bad += [f"{point}, SIG{sig} of rank {victim}: {p}" for p in row.problems]
        for o in row.survivors:
            where = f"{point}, SIG{sig} of rank {victim}: rank {o.rank}"
            if not o.ok:
                bad.append(f"{where} did not report: {o.error}: {o.message[:300]}")
                continue
            error, named, message, seconds = o.value
            blamed = message.replace(f"rank {o.rank} gave up", "")
            if not named:
                bad.append(f"{where} raised {error}, not a PdcompileError: {message[:300]}")
            elif f"rank {victim}" not in blamed and "another rank" not in blamed:
                bad.append(f"{where}: the message names no rank at fault: {message[:400]}")
            elif not seconds < STARTUP_S + MARGIN_S:
                bad.append(f"{where}: {seconds:.1f} s to the error: {message[:300]}")
    assert not bad, "\n".join(bad) + "\n" + table
