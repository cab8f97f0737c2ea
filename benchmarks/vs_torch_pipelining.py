"""pdcompile's modern schedules against torch.distributed.pipelining's, on 2 gloo CPU ranks.

    python benchmarks/vs_torch_pipelining.py [--steps 3] [--rounds 5] [--json out.json]

The same model (a chain of 8 Linear(256, 256) with ReLU between, batch 64, MSE loss), the same
split into 4 stages (pdcompile's uniform cut: 2 Linear a stage), the same 4 microbatches and
SGD(lr=0.01), on 2 spawned gloo ranks with one thread each. Pairs, with the same placement on
both sides:

- pdcompile `interleaved-1f1b` (chunks=2, stage i on rank i mod 2) / `ScheduleInterleaved1F1B`
- pdcompile `zb-h1` (chunks=2, same placement) / `ScheduleInterleavedZeroBubble`
- pdcompile `zb-v` (stages 0 and 3 on rank 0, 1 and 2 on rank 1) / `ScheduleZBVZeroBubble`

torch runs pdcompile's own stage modules (copies, so both start from the same parameters)
through thin adapters taking and returning positional tensors. The two runtimes alternate
round by round in the same processes; per pair: whether the per-step losses are equal (within
1e-5: pdcompile reports the mean in float64, torch's losses are float32), and the median over
rounds of the per-round ratios pdcompile / torch (below 1: pdcompile faster) of wall time per
step (rank 0) and of CPU time per step (`time.process_time`, rank 0's plus rank 1's).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline

MICROBATCHES = 4
WIDTH, LAYERS, BATCH = 256, 8, 64
PAIRS = {  # pdcompile schedule: torch schedule class
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zb-v": "ScheduleZBVZeroBubble",
}


def make_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH)]
    for _ in range(LAYERS - 1):  # no ReLU after the last: the uniform cut gives 2 Linear a stage
        layers += [nn.ReLU(), nn.Linear(WIDTH, WIDTH)]
    return nn.Sequential(*layers), torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)


def build_program(kind: str) -> pdcompile.StagedProgram:
    model, x, _ = make_case()
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False)
    plan = pdcompile.plan(costs, "2", schedule=kind, chunks=2, solver="uniform",
                          num_microbatches=MICROBATCHES)  # fmt: skip
    return pdcompile.codegen(gm, plan)


class Adapter(nn.Module):
    """A pdcompile stage (keyword inputs, a dict of outputs unless last) for torch's pipelining:
    positional tensors in, a tensor (or a tuple of them) out."""

    def __init__(self, stage: nn.Module, inputs: list[str], outputs: list[str] | None) -> None:
        super().__init__()
        self.stage, self.inputs, self.outputs = stage, inputs, outputs

    def forward(self, *values: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        assert len(values) == len(self.inputs), (self.inputs, len(values))
        out = self.stage(*values)  # in the order of the signature's inputs
        if self.outputs is None:
            return out
        picked = tuple(out[n] for n in self.outputs) if isinstance(out, dict) else tuple(out)
        return picked[0] if len(picked) == 1 else picked


def _timed(run, steps: int) -> tuple[float, float]:
    """Wall seconds and CPU seconds per step on this rank."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        run()
    dist.barrier()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def _agree(error: str | None) -> None:
    """Raise on every rank when one of them failed, so that none waits for a peer that left."""
    errors = [None, None]
    dist.all_gather_object(errors, error)
    if any(errors):
        raise RuntimeError(next(e for e in errors if e))


def _compare(kind: str, rank: int, device: torch.device, group, steps: int, rounds: int) -> dict:
    try:
        runtimes = _build(kind, rank, device, group)
    except Exception as exc:
        _agree(f"rank {rank}: {type(exc).__name__}: {exc}")
    _agree(None)
    our_step, torch_step, losses, ranks = runtimes
    for step in (our_step, torch_step):  # warm up both; torch's first step may refuse
        try:
            step()
        except Exception as exc:
            _agree(f"rank {rank}: {type(exc).__name__}: {exc}")
        _agree(None)
    times: dict[str, list[tuple[float, float]]] = {"pdcompile": [], "torch": []}
    for _ in range(rounds):
        times["pdcompile"].append(_timed(our_step, steps))
        times["torch"].append(_timed(torch_step, steps))
    return {"times": times, "losses": losses, "placement": ranks}


def _build(kind: str, rank: int, device: torch.device, group) -> tuple:
    """Both runtimes' steps on this rank, the per-step losses they record, the placement."""
    from torch.distributed.pipelining import PipelineStage, schedules

    _, x, y = make_case()
    program = build_program(kind)
    ranks = [s.ranks[0] for s in program.plan.stages]
    sgd = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731
    ours = DistributedPipeline(
        copy.deepcopy(program), rank=rank, schedule=kind, num_microbatches=MICROBATCHES,
        loss_fn=F.mse_loss, optimizer=sgd, device=device, timeout_s=60,
    )  # fmt: skip
    theirs = copy.deepcopy(program)
    n = len(theirs.stages)
    mine = [i for i in range(n) if ranks[i] == rank]
    adapters = [
        Adapter(theirs.stages[i], list(theirs.signatures[i].inputs),
                None if i == n - 1 else list(theirs.signatures[i].outputs))
        for i in mine
    ]  # fmt: skip
    stages = [
        PipelineStage(a, i, n, device, group=group) for a, i in zip(adapters, mine, strict=True)
    ]
    schedule = getattr(schedules, PAIRS[kind])(stages, MICROBATCHES, loss_fn=F.mse_loss)
    opt = sgd([p for a in adapters for p in a.parameters()])
    losses: dict[str, list[float]] = {"pdcompile": [], "torch": []}

    def torch_step() -> None:
        mb: list[torch.Tensor] = []
        args = (x,) if 0 in mine else ()
        kwargs = {"target": y, "losses": mb} if n - 1 in mine else {}
        schedule.step(*args, **kwargs)
        opt.step()
        opt.zero_grad()
        if mb:
            losses["torch"].append(float(torch.stack(mb).detach().mean()))

    def our_step() -> None:
        losses["pdcompile"].append(float(ours.train_step((x,), y)))

    return our_step, torch_step, losses, ranks


def _rank(rank: int, world_size: int, init_file: str, steps: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    group = dist.new_group([0, 1])  # torch's messages never meet pdcompile's
    results = {}
    for kind in PAIRS:
        try:
            results[kind] = _compare(kind, rank, device, group, steps, rounds)
        except Exception as exc:  # a schedule refusing: reported, the others still run
            results[kind] = {"error": f"{type(exc).__name__}: {exc}"}
            if rank == 0:
                print(f"{kind}: {results[kind]['error']}", file=sys.stderr, flush=True)
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def summarize(per_rank: list[dict]) -> dict:
    summary = {}
    for kind in PAIRS:
        parts = [r.get(kind) for r in per_rank]
        errors = [p["error"] for p in parts if p and "error" in p]
        if errors or None in parts:
            summary[kind] = {"error": errors[0] if errors else "not run"}
            continue
        losses = {
            rt: next(p["losses"][rt] for p in parts if p["losses"][rt])
            for rt in ("pdcompile", "torch")
        }
        # pdcompile reports the mean loss in float64, torch's losses are float32
        gap = max(abs(a - b) for a, b in zip(losses["pdcompile"], losses["torch"], strict=False))
        equal = len(losses["pdcompile"]) == len(losses["torch"]) and gap <= 1e-5
        rounds = {
            rt: [
                (a[0], a[1] + b[1])
                for a, b in zip(parts[0]["times"][rt], parts[1]["times"][rt], strict=True)
            ]
            for rt in ("pdcompile", "torch")
        }
        pairs = list(zip(rounds["pdcompile"], rounds["torch"], strict=True))
        summary[kind] = {
            "torch_schedule": PAIRS[kind],
            "placement": parts[0]["placement"],
            "losses_equal": equal,
            "steps": len(losses["torch"]),
            "max_loss_gap": gap,
            "first_loss": {rt: v[0] for rt, v in losses.items()},
            "last_loss": {rt: v[-1] for rt, v in losses.items()},
            "wall_per_step_s": {rt: statistics.median(t[0] for t in v) for rt, v in rounds.items()},
            "cpu_per_step_s": {rt: statistics.median(t[1] for t in v) for rt, v in rounds.items()},
            "time_ratio": statistics.median(o[0] / t[0] for o, t in pairs),
            "cpu_ratio": statistics.median(o[1] / t[1] for o, t in pairs),
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per round and runtime")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), args.steps, args.rounds, out),
                 nprocs=2, join=True)  # fmt: skip
        with open(out) as f:
            summary = summarize(json.load(f))
    table = Table(title=f"2 gloo ranks, 1 thread each, {LAYERS} Linear({WIDTH}) with ReLU between, "
                        f"batch {BATCH}, 4 stages, {MICROBATCHES} microbatches (medians of "
                        f"{args.rounds} alternating rounds of {args.steps} steps)")  # fmt: skip
    for column in ("schedule pair", "losses equal (max gap)", "pdcompile / step", "torch / step",
                   "time ratio", "CPU ratio (both ranks)"):  # fmt: skip
        table.add_column(column, justify="right")
    for kind, s in summary.items():
        pair = f"{kind} / {PAIRS[kind]}"
        if "error" in s:
            table.add_row(pair, "-", "-", "-", "-", s["error"][:60])
            continue
        wall = s["wall_per_step_s"]
        table.add_row(pair, f"{'yes' if s['losses_equal'] else 'NO'} ({s['max_loss_gap']:.1e})",
                      f"{wall['pdcompile'] * 1e3:.1f} ms", f"{wall['torch'] * 1e3:.1f} ms",
                      f"{s['time_ratio']:.2f}x", f"{s['cpu_ratio']:.2f}x")  # fmt: skip
    Console(width=140).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
