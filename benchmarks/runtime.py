"""Runtime benchmark: pdcompile's `1f1b` against torch.distributed.pipelining's `Schedule1F1B`.

    python benchmarks/runtime.py [--steps 10] [--rounds 5] [--json out.json] [--default-malloc]
        [--deepspeed DSVENV/bin/python]

Two gloo ranks with one thread each run the same 2-stage split (pdcompile's stage modules; torch
runs them through thin adapters taking and returning positional tensors) with 8 microbatches,
alternating the two runtimes round by round in the same processes; with `--deepspeed`,
DeepSpeed's pipeline engine too, in processes of its own started from rank 0 after each round
(`benchmarks/deepspeed_pipe.py`, which says how to install it). Per runtime: the median over
rounds of wall time and CPU time per step (rank 0's CPU plus rank 1's), and the median over
rounds of the ratio of pdcompile to each in the same round, and the minor page faults per step.
The ranks run with glibc's malloc keeping freed memory (`cases.KEEP_FREED_MEMORY`;
`--default-malloc` runs without), as both runtimes share the processes. Then `pipedream` runs for
the same steps with its action timeline recorded: steady-state throughput (minibatches per second
over the second half) against the ideal 1 / max over stages of a stage's forward + backward time
per minibatch, from the same timeline, and each rank's milliseconds per minibatch by kind of
action.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from cases import CASES, keep_freed_memory
from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline

MICROBATCHES = 8


def two_stage_program(model: nn.Module, x: torch.Tensor) -> pdcompile.StagedProgram:
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False)
    return pdcompile.codegen(gm, pdcompile.plan(costs, pdcompile.Cluster.parse("2"),
                                                solver="blocks"))  # fmt: skip


class _First(nn.Module):
    """Stage 0 for torch's pipelining: positional input, a tuple of the channel tensors."""

    def __init__(self, stage: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.stage, self.names = stage, names

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.stage(x)
        return tuple(out[n] for n in self.names)


class _Last(nn.Module):
    def __init__(self, stage: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.stage, self.names = stage, names

    def forward(self, *values: torch.Tensor) -> torch.Tensor:
        return self.stage(**dict(zip(self.names, values, strict=True)))


def _step_times(run, steps: int) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and minor page faults per step."""
    dist.barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        run()
    dist.barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps, faults / steps


def _rank(
    rank: int, world_size: int, init_file: str, steps: int, rounds: int, out: str,
    deepspeed: str | None,
) -> None:  # fmt: skip
    torch.set_num_threads(1)
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=600)
    results = {name: _compare(name, rank, device, steps, rounds, deepspeed) for name in CASES}
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def _compare(
    name: str, rank: int, device: torch.device, steps: int, rounds: int, deepspeed: str | None
) -> dict:
    """The runtimes on one model, alternating round by round (DeepSpeed's in processes of its
    own, started from rank 0 between the others' rounds)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model, x, y, loss_fn = CASES[name]()
    sgd = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731
    ours = DistributedPipeline(
        two_stage_program(model, x), rank=rank, schedule="1f1b",
        num_microbatches=MICROBATCHES, loss_fn=loss_fn, optimizer=sgd, device=device,
    )  # fmt: skip
    program = two_stage_program(model, x)
    names = [c.name for c in program.channels]
    stage = program.stages[rank]
    adapter = _First(stage, names) if rank == 0 else _Last(stage, names)
    # a group of its own, so that torch's messages never meet pdcompile's
    torch_stage = PipelineStage(adapter, rank, 2, device, group=dist.new_group([0, 1]))
    schedule = Schedule1F1B(torch_stage, MICROBATCHES, loss_fn=loss_fn)
    opt = sgd(adapter.parameters())

    def torch_step() -> None:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        opt.step()
        opt.zero_grad()

    def our_step() -> None:
        ours.train_step((x,), y)

    our_step()  # warm up both
    torch_step()
    times: dict[str, list[tuple[float, float, float]]] = {"pdcompile": [], "torch": []}
    if deepspeed:
        times["deepspeed"] = []
    for _ in range(rounds):
        times["pdcompile"].append(_step_times(our_step, steps))
        times["torch"].append(_step_times(torch_step, steps))
        if deepspeed:
            times["deepspeed"].append(_deepspeed_round(name, rank, steps, deepspeed))
    return {"times": times, "pipedream": _pipedream(model, x, y, loss_fn, rank, device, steps)}


def _deepspeed_round(name: str, rank: int, steps: int, python: str) -> tuple[float, float, float]:
    """One round of `benchmarks/deepspeed_pipe.py` under `python` (rank 0 starts it while rank 1
    waits): this rank's wall and CPU seconds per step there (page faults not counted: 0)."""
    shared: list = [None]
    dist.barrier()
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "deepspeed.json")
            script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_pipe.py")
            env = {**os.environ, "DS_ACCELERATOR": "cpu"}
            subprocess.run([python, script, "--model", name, "--steps", str(steps), "--out", out],
                           check=True, env=env, capture_output=True)  # fmt: skip
            with open(out) as f:
                shared = [json.load(f)]
    dist.broadcast_object_list(shared, src=0)
    mine = shared[0][rank]
    return mine["wall"], mine["cpu"], 0.0


def _pipedream(model, x, y, loss_fn, rank, device, steps) -> dict:
    """Steady-state minibatches per second, the stage's compute per minibatch, and the
    milliseconds per minibatch of each kind of action (waits included: a `recv` or `allreduce`
    lasts until its peer is there)."""
    pipeline = DistributedPipeline(
        two_stage_program(model, x), rank=rank, schedule="pipedream",
        num_microbatches=MICROBATCHES, loss_fn=loss_fn,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device=device,
    )  # fmt: skip
    pipeline.worker.timeline = []
    for _ in range(steps):
        pipeline.train_step((x,), y)
    pipeline.flush()
    events = pipeline.worker.timeline
    half = len(events) // 2
    compute = [e for e in events[half:] if e.kind in ("F", "B")]
    minibatches = sum(1 for e in compute if e.kind == "B")
    span = events[-1].end - events[half].start
    busy = sum(e.duration for e in compute)
    per_kind: dict[str, float] = {}
    for e in events[half:]:
        per_kind[e.kind] = per_kind.get(e.kind, 0.0) + e.duration
    return {
        "throughput": minibatches / span,
        "compute_per_minibatch": busy / minibatches,
        "ms_per_minibatch": {k: v / minibatches * 1e3 for k, v in per_kind.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--default-malloc", action="store_true")
    parser.add_argument(
        "--deepspeed", metavar="PYTHON",
        help="also run DeepSpeed's pipeline engine with this interpreter (a venv of its own: "
        "benchmarks/deepspeed_pipe.py)",
    )  # fmt: skip
    args = parser.parse_args()
    keep_freed_memory(args.default_malloc)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), args.steps, args.rounds, out,
                              args.deepspeed), nprocs=2, join=True)  # fmt: skip
        with open(out) as f:
            per_rank = json.load(f)
    console = Console()
    malloc = "default malloc" if args.default_malloc else "malloc keeping freed memory"
    table = Table(title=f"2 gloo ranks, 1 thread each, 2 stages, 8 microbatches, {malloc} "
                        "(medians)")  # fmt: skip
    columns = ("model", "runtime", "wall / step", "CPU / step (both ranks)",
               "page faults / step", "paired ratio pdcompile / it (time, CPU)")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    summary = {}
    for name in CASES:
        medians, per_round = {}, {}
        for runtime in per_rank[0][name]["times"]:
            first, second = (per_rank[r][name]["times"][runtime] for r in range(2))
            walls = [t[0] for t in first]
            cpus = [a[1] + b[1] for a, b in zip(first, second, strict=True)]
            faults = [a[2] + b[2] for a, b in zip(first, second, strict=True)]
            per_round[runtime] = (walls, cpus)
            medians[runtime] = (statistics.median(walls), statistics.median(cpus),
                                statistics.median(faults))  # fmt: skip
        # each round ran the runtimes back to back: the median of per-round ratios is the
        # comparison least disturbed by a noisy machine
        ratios = {
            peer: [
                statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
                for ours, theirs in zip(per_round["pdcompile"], rounds, strict=True)
            ]
            for peer, rounds in per_round.items()
        }
        for runtime, (wall, cpu, faults) in medians.items():
            paired = f"{ratios[runtime][0]:.2f}x, {ratios[runtime][1]:.2f}x"
            table.add_row(name, runtime, f"{wall * 1e3:.1f} ms", f"{cpu * 1e3:.1f} ms",
                          f"{faults:.0f}" if runtime != "deepspeed" else "-", paired)  # fmt: skip
        stages = [per_rank[r][name]["pipedream"] for r in range(2)]
        ideal = 1 / max(s["compute_per_minibatch"] for s in stages)
        achieved = min(s["throughput"] for s in stages)
        summary[name] = {
            "medians": medians, "paired_time_ratio": ratios["torch"][0],
            "paired_cpu_ratio": ratios["torch"][1], "paired_ratios": ratios,
            "pipedream_throughput": achieved, "pipedream_ideal": ideal,
            "pipedream_fraction": achieved / ideal,
        }  # fmt: skip
    console.print(table)
    for name, s in summary.items():
        console.print(
            f"{name}: pipedream steady state {s['pipedream_throughput']:.1f} minibatches/s, "
            f"ideal {s['pipedream_ideal']:.1f} (slowest stage's F+B), "
            f"{s['pipedream_fraction']:.0%} of ideal"
        )
        for rank in range(2):
            kinds = per_rank[rank][name]["pipedream"]["ms_per_minibatch"]
            console.print(
                f"  rank {rank} ms per minibatch: "
                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
