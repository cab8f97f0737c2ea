"""Simulator benchmark: how fast `pdcompile.simulate` is, and how well it predicts real runs.

    python benchmarks/simulator.py [--steps 5] [--rounds 5] [--scale-only | --skip-scale]
                                   [--json FILE] [--trace-dir DIR] [--default-malloc]

1. Scale: 64 stages x 512 microbatches under every schedule (best of 3 wall times).
2. Predicted against measured: the MLP and the GPT-style decoder of benchmarks/runtime.py, cut in
   the same 2 stages, on 2 gloo ranks with one thread each, 8 microbatches, under `1f1b`,
   `gpipe`, `pipedream` and `2bw`. In each of `--rounds` rounds the ranks calibrate
   (`runtime/calibration.py`: link latency and bandwidth, the runtime's per-message and
   per-tensor costs, memory bandwidth), then, for each schedule in turn, each rank profiles the
   model (one thread, at the microbatch size) while the other trains its stage in a loop, as in
   the run, and both time `--steps` train steps. The simulator predicts each run's time per
   step from the calibration and profiles taken just before it (stage s priced by rank s's
   profile: the two cores do not run at one speed), and the table gives the medians over rounds
   and the median of the paired ratios: this machine's speed drifts by tens of percent within
   minutes. The ranks run
   with glibc's malloc keeping freed memory (`KEEP_FREED_MEMORY`; `--default-malloc` runs
   without): otherwise whether a backward's gradients land on pages the allocator just gave
   back to the system, at a page fault per 4 KiB, changes its time by up to 2x, in the profile
   and in the run alike (docs/simulator.md). A second prediction takes the stages' forward and
   backward times from one measured step's timeline instead of the profile, which separates the
   profile's error from the simulator's; a third table compares every kind of action's median
   duration, simulated and measured. `--trace-dir` writes that step's timeline and the
   simulation as Chrome traces, and both as one Gantt PNG.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cases import CASES, keep_freed_memory
from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile import Cluster, CostGraph, Plan, Stage
from pdcompile.passes.planning.plans import consecutive_ranks
from pdcompile.passes.planning.timeline import Event, to_chrome_trace
from pdcompile.runtime.calibration import Calibration, calibrate
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline

MICROBATCHES = 8
SCHEDULES = ("1f1b", "gpipe", "pipedream", "2bw")  # PipeDream's family, measured here
# glibc: allocations up to 32 MiB from the heap, which is never trimmed (no page faults on reuse)
KINDS = ("F", "B", "send", "recv", "allreduce", "step", "push")  # compared action by action


def optimizer(params):
    return torch.optim.SGD(params, lr=0.001)


# -- 1. scale ------------------------------------------------------------------------------


def synthetic_plan(stages: int) -> Plan:
    """`stages` equal stages (1 ms forward, 2 ms backward, 1 MB to the next) on 8-GPU servers."""
    ranks = consecutive_ranks([1] * stages)
    return Plan(
        stages=tuple(
            Stage(
                index=i,
                nodes=(f"n{i}",),
                replicas=1,
                ranks=ranks[i],
                forward_s=1e-3,
                backward_s=2e-3,
                recv_bytes=((i - 1, 2**20),) if i else (),
                activation_bytes=2**24,
                param_bytes=2**22,
                grad_bytes=2**22,
                weight_bytes=2**23,
            )
            for i in range(stages)
        ),  # fmt: skip
        cluster=Cluster.parse(f"8@300GB/s,{-(-stages // 8)}@25Gbit/s"),
    )


def scale(stages: int = 64, microbatches: int = 512, repeats: int = 3) -> list[dict]:
    plan = synthetic_plan(stages)
    rows = []
    for kind in SCHEDULES:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            sim = pdcompile.simulate(plan, schedule=kind, num_microbatches=microbatches)
            best = min(best, time.perf_counter() - start)
        rows.append({"schedule": kind, "stages": stages, "microbatches": microbatches,
                     "actions": len(sim.timeline), "seconds": best})  # fmt: skip
    return rows


# -- 2. predicted against measured ---------------------------------------------------------


def two_stage_program(model, x) -> pdcompile.StagedProgram:
    """The 2-stage split of benchmarks/runtime.py (balanced by analytic time)."""
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False)
    return pdcompile.codegen(gm, pdcompile.plan(costs, Cluster.parse("2"), solver="blocks"))


def profile(model, x) -> CostGraph:
    """The model's costs at the microbatch size (this process's threads: one in the ranks)."""
    micro = x[: x.shape[0] // MICROBATCHES]
    return pdcompile.analyze(pdcompile.trace(model, (micro,)), (micro,), cache=False,
                             progress=False)  # fmt: skip


def own_stage(model, x, y, loss_fn, rank: int) -> Callable[[], None]:
    """A forward and backward of a private copy of this rank's stage on one microbatch (its
    gradients never reach the model), as the rank trains it in the run."""
    program = two_stage_program(model, x)
    micro, target = x[: x.shape[0] // MICROBATCHES], y[: x.shape[0] // MICROBATCHES]
    stage = copy.deepcopy(program.stages[rank])
    inputs = {k: v.detach() for k, v in program.stages[0](micro).items()}

    def train() -> None:
        if rank == 0:
            outputs = [v for v in stage(micro).values() if v.requires_grad]
        else:
            args = {k: v.requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
            outputs = [loss_fn(stage(**args), target)]
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])

    return train


def profile_under_load(model, x, train: Callable[[], None], rank: int, flag: Path) -> list[dict]:
    """Each rank's profile (JSON), taken in turn while the other rank trains its stage in a loop
    (`train`, from `own_stage`), as it does in the run: the two cores share the machine's
    caches, memory and, under a hypervisor, maybe more. The profiling rank ends the loop by
    creating the file `flag`."""
    both: list = [None, None]
    for turn in (0, 1):
        dist.barrier()
        if rank == turn:
            mine = profile(model, x).to_json()
            flag.touch()
        else:
            while not flag.exists():
                train()
        dist.barrier()
        if rank == turn:
            flag.unlink()
    dist.all_gather_object(both, mine)
    return both


def _rank(rank: int, world_size: int, init_file: str, steps: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=300)
    results: dict = {"cases": {}}
    for name, make in CASES.items():
        flag = Path(init_file).with_name("profiled")
        results["cases"][name] = _measure(make, rank, device, steps, rounds, flag)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _measure(make, rank, device, steps: int, rounds: int, flag: Path) -> dict:
    """Per round, the model's profile and the seconds per train step of every schedule; one
    step's events per schedule. Each schedule's steps of a round follow a profile of their own:
    this machine's speed drifts by tens of percent within minutes, so each run is predicted from
    a profile taken just before it."""
    model, x, y, loss_fn = make()
    pipelines = {
        kind: DistributedPipeline(
            two_stage_program(model, x), rank=rank, schedule=kind,
            num_microbatches=MICROBATCHES, loss_fn=loss_fn, device=device, optimizer=optimizer,
        )
        for kind in SCHEDULES
    }  # fmt: skip
    for pipeline in pipelines.values():  # an untimed round; pipedream fills its pipeline
        for _ in range(steps):
            pipeline.train_step((x,), y)
    seconds: dict[str, list[float]] = {kind: [] for kind in SCHEDULES}
    profiles: dict[str, list[list[dict]]] = {kind: [] for kind in SCHEDULES}
    calibrations = []
    train = own_stage(model, x, y, loss_fn, rank)
    for r in range(rounds):
        calibrations.append(dataclasses.asdict(calibrate(rank, device, optimizer)))
        order = SCHEDULES[r % len(SCHEDULES) :] + SCHEDULES[: r % len(SCHEDULES)]
        for kind in order:
            profiles[kind].append(profile_under_load(model, x, train, rank, flag))
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                pipelines[kind].train_step((x,), y)
            seconds[kind].append((time.perf_counter() - start) / steps)
    events: dict[str, list] = {}
    for kind, pipeline in pipelines.items():
        pipeline.worker.timeline = []
        dist.barrier()
        pipeline.train_step((x,), y)
        everyone: list = [None, None]
        dist.all_gather_object(everyone, pipeline.worker.timeline)
        events[kind] = [e._asdict() for part in everyone for e in part]
        pipeline.worker.timeline = None
        pipeline.flush()
    return {"seconds": seconds, "events": events, "profiles": profiles,
            "calibrations": calibrations}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale-only", action="store_true")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--trace-dir", metavar="DIR")
    parser.add_argument("--default-malloc", action="store_true")
    args = parser.parse_args()
    console = Console(width=150)
    summary: dict = {}
    if not args.skip_scale:
        summary["scale"] = scale()
        table = Table(title="simulate: 64 stages x 512 microbatches (best of 3)")
        for column in ("schedule", "actions", "seconds"):
            table.add_column(column, justify="right")
        for row in summary["scale"]:
            table.add_row(row["schedule"], str(row["actions"]), f"{row['seconds']:.2f}")
        console.print(table)
    if not args.scale_only:
        summary["predicted"] = predicted_against_measured(args, console)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


def predicted_against_measured(args: argparse.Namespace, console: Console) -> dict:
    keep_freed_memory(args.default_malloc)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), args.steps, args.rounds, out),
                 nprocs=2, join=True)  # fmt: skip
        measured = json.loads(Path(out).read_text())
    table = Table(title=f"time per step, 2 gloo ranks, 1 thread each, {MICROBATCHES} microbatches")
    for column in ("model", "schedule", "simulated", "measured", "ratio",
                   "sim. on measured F/B", "ratio", "rounds (ms)"):  # fmt: skip
        table.add_column(column, justify="right")
    actions = Table(title="median seconds per action, simulated / measured (ms)")
    for column in ("model", "schedule", *KINDS):
        actions.add_column(column, justify="right")
    rows = {}
    for name, make in CASES.items():
        model, x, _, _ = make()
        program_plan = two_stage_program(model, x).plan
        case = measured["cases"][name]
        calibrations = [Calibration(**c) for c in case["calibrations"]]
        console.print(calibration_table(name, calibrations))
        clusters = [c.cluster(2) for c in calibrations]
        for kind in SCHEDULES:
            rounds = zip(case["profiles"][kind], clusters, strict=True)
            plans = [stages_on_their_ranks(program_plan, both, c) for both, c in rounds]
            sims = [pdcompile.simulate(plan, schedule=kind, num_microbatches=MICROBATCHES)
                    for plan in plans]  # fmt: skip
            sim = sims[-1]  # the last round's, for the timeline comparisons
            events = [Event(**e) for e in case["events"][kind]]
            replay = pdcompile.simulate(
                with_measured_compute(plans[-1], sim, events), schedule=kind,
                num_microbatches=MICROBATCHES,
            )  # fmt: skip
            runs = case["seconds"][kind]
            median = statistics.median(runs)
            # each round predicted from its own profile: the median of the paired ratios
            ratio = statistics.median(p.time_per_step / t for p, t in zip(sims, runs, strict=True))
            predicted = statistics.median(p.time_per_step for p in sims)
            per_action = {k: (_median(sim.timeline, k), _median(events, k)) for k in KINDS}
            rows[f"{name}/{kind}"] = {
                "simulated": predicted, "measured": median, "ratio": ratio,
                "simulated_per_round": [p.time_per_step for p in sims],
                "simulated_on_measured_compute": replay.time_per_step,
                "ratio_on_measured_compute": replay.time_per_step / median,
                "rounds": runs, "bubble": sim.bubble_fraction, "actions": per_action,
            }  # fmt: skip
            table.add_row(name, kind, f"{predicted * 1e3:.1f} ms", f"{median * 1e3:.1f} ms",
                          f"{ratio:.2f}", f"{replay.time_per_step * 1e3:.1f} ms",
                          f"{replay.time_per_step / median:.2f}",
                          " ".join(f"{t * 1e3:.0f}" for t in runs))  # fmt: skip
            actions.add_row(name, kind, *(
                "-" if m is None else f"{(s or 0) * 1e3:.2f} / {m * 1e3:.2f}"
                for s, m in per_action.values()
            ))  # fmt: skip
            if args.trace_dir:
                _write_traces(Path(args.trace_dir), f"{name}_{kind}", events, sim)
    console.print(table)
    console.print(actions)
    malloc = os.environ.get("GLIBC_TUNABLES", "default")
    calibrations = {name: case["calibrations"] for name, case in measured["cases"].items()}
    return {"calibrations": calibrations, "malloc": malloc, "rows": rows}


def stages_on_their_ranks(plan: Plan, profiles: list[dict], cluster: Cluster) -> Plan:
    """`plan` priced with stage s's times from the profile rank s took (the ranks' cores do not
    run at the same speed here: one is about 20% slower)."""
    priced = [pdcompile.evaluate(plan, CostGraph.from_json(p), cluster=cluster) for p in profiles]
    return priced[0].with_(stages=tuple(priced[s].stages[s] for s in range(plan.num_stages)))


def calibration_table(name: str, rounds: list[Calibration]) -> Table:
    table = Table(title=f"calibrated between the two ranks in each round of the {name} "
                        "(runtime/calibration.py)")  # fmt: skip
    for column in ("latency", "bandwidth", "send", "recv", "memory bandwidth", "per tensor",
                   "all-reduce (fixed)"):  # fmt: skip
        table.add_column(column, justify="right")
    for c in rounds:
        table.add_row(f"{c.latency * 1e6:.0f} us", f"{c.bandwidth / 1e9:.2f} GB/s",
                      f"{c.send_s * 1e6:.0f} us", f"{c.recv_s * 1e6:.0f} us",
                      f"{c.memory_bandwidth / 1e9:.1f} GB/s", f"{c.tensor_s * 1e6:.2f} us",
                      f"{c.collective_s * 1e6:.0f} us")  # fmt: skip
    return table


def _median(events: list[Event], kind: str) -> float | None:
    durations = [e.duration for e in events if e.kind == kind]
    return statistics.median(durations) if durations else None


def with_measured_compute(plan: Plan, sim, events: list[Event]) -> Plan:
    """`plan` with each stage's forward and backward seconds the medians of a measured
    timeline's, less the median work on the weights `sim` adds to them (swapping a copy in,
    accumulating gradients), so that the replay's F and B take the measured time."""
    stages = []
    for s in plan.stages:
        seconds = {}
        for kind, profiled in (("F", s.forward_s), ("B", s.backward_s)):
            measured = [e.duration for e in events if e.stage == s.index and e.kind == kind]
            added = [e.duration - profiled for e in sim.timeline
                     if e.stage == s.index and e.kind == kind]  # fmt: skip
            seconds[kind] = max(statistics.median(measured) - statistics.median(added), 0.0)
        stages.append(dataclasses.replace(s, forward_s=seconds["F"], backward_s=seconds["B"]))
    return plan.with_(stages=tuple(stages))


def _write_traces(folder: Path, stem: str, measured: list[Event], sim) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    to_chrome_trace(measured, folder / f"{stem}_measured.json")
    sim.to_chrome_trace(folder / f"{stem}_simulated.json")
    from pdcompile.pictures.gantt import plot_timelines

    plot_timelines([(f"measured {stem}", measured), (f"simulated {stem}", sim.timeline)],
                   folder / f"{stem}.png")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
