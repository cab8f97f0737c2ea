"""pdcompile's modern schedules against torch.distributed.pipelining's, on 2 gloo CPU ranks.

    python benchmarks/vs_torch_pipelining.py [--model {mlp,transformer}] [--steps 3] [--rounds 5]
        [--json out.json]

Two models (both unless `--model` picks one), each a chain of 8 blocks, MSE loss against a random
target of the output's shape:

- `mlp`: 8 Linear(256, 256) with ReLU between, batch 64;
- `transformer`: 8 `nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512,
  dropout=0.0, batch_first=True)`, batch 32 of 32 tokens. The layers are traced as leaves, so
  that the uniform cut (equal node counts) falls between them. No input projection or output
  head: with them the 10 nodes would split 3/3/3/1 (a last stage holding the head alone).

Per model, the same split into 4 stages (pdcompile's uniform cut: 2 blocks a stage), the same 4
microbatches and SGD(lr=0.01), on 2 spawned gloo ranks with one thread each. Pairs, with the same
placement on both sides:

- pdcompile `interleaved-1f1b` (chunks=2, stage i on rank i mod 2) / `ScheduleInterleaved1F1B`
- pdcompile `zb-h1` (chunks=2, same placement) / `ScheduleInterleavedZeroBubble`
- pdcompile `zb-v` (stages 0 and 3 on rank 0, 1 and 2 on rank 1) / `ScheduleZBVZeroBubble`
- pdcompile `dualpipev` (the same V) / `ScheduleDualPipeV`
- pdcompile `looped-bfs` (chunks=2, round-robin) / `ScheduleLoopedBFS`

torch runs pdcompile's own stage modules (copies, so both start from the same parameters)
through thin adapters taking and returning positional tensors. The two runtimes alternate
round by round in the same processes; per model and pair: whether the per-step losses are equal
(within 1e-5: pdcompile reports the mean in float64, torch's losses are float32), and the median
over rounds of the per-round ratios pdcompile / torch (below 1: pdcompile faster) of wall time
per step (rank 0) and of CPU time per step (`time.process_time`, rank 0's plus rank 1's). The
JSON file holds one summary per model.
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
PAIRS = {  # pdcompile schedule: torch schedule class
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zb-v": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
    "looped-bfs": "ScheduleLoopedBFS",
}
LEAVES = (nn.TransformerEncoderLayer,)  # traced whole: the cut falls between blocks


def mlp() -> tuple[nn.Module, torch.Tensor]:
    layers: list[nn.Module] = [nn.Linear(256, 256)]
    for _ in range(7):  # no ReLU after the last: the uniform cut gives 2 Linear a stage
        layers += [nn.ReLU(), nn.Linear(256, 256)]
    return nn.Sequential(*layers), torch.randn(64, 256)


def transformer() -> tuple[nn.Module, torch.Tensor]:
    blocks = [
        nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, dropout=0.0,
                                   batch_first=True)
        for _ in range(8)
    ]  # fmt: skip
    return nn.Sequential(*blocks), torch.randn(32, 32, 128)  # batch, tokens, d_model


MODELS = {  # name: (builder, description for the table's title)
    "mlp": (mlp, "8 Linear(256) with ReLU between, batch 64"),
    "transformer": (transformer, "8 TransformerEncoderLayer(128, 4 heads, FFN 512), batch 32 x 32"),
}


def make_case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model, its input and its target, the same on every rank."""
    torch.manual_seed(0)
    model, x = MODELS[name][0]()
    return model, x, torch.randn_like(x)


def build_program(name: str, kind: str) -> pdcompile.StagedProgram:
    model, x, _ = make_case(name)
    gm = pdcompile.trace(model, (x,), leaf_modules=LEAVES)
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


def _compare(
    name: str, kind: str, rank: int, device: torch.device, group, steps: int, rounds: int
) -> dict:
    try:
        runtimes = _build(name, kind, rank, device, group)
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


def _build(name: str, kind: str, rank: int, device: torch.device, group) -> tuple:
    """Both runtimes' steps on this rank, the per-step losses they record, the placement."""
    from torch.distributed.pipelining import PipelineStage, schedules

    _, x, y = make_case(name)
    program = build_program(name, kind)
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


def _rank(
    rank: int, world_size: int, init_file: str, names: list[str], steps: int, rounds: int, out: str
) -> None:
    torch.set_num_threads(1)
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    group = dist.new_group([0, 1])  # torch's messages never meet pdcompile's
    results: dict[str, dict] = {name: {} for name in names}
    for name in names:
        for kind in PAIRS:
            try:
                results[name][kind] = _compare(name, kind, rank, device, group, steps, rounds)
            except Exception as exc:  # a schedule refusing: reported, the others still run
                results[name][kind] = {"error": f"{type(exc).__name__}: {exc}"}
                if rank == 0:
                    print(f"{name} {kind}: {results[name][kind]['error']}", file=sys.stderr,
                          flush=True)  # fmt: skip
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def summarize(per_rank: list[dict]) -> dict:
    """One model's pairs: `per_rank` holds each rank's results for it, by pdcompile schedule."""
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


def print_table(name: str, summary: dict, steps: int, rounds: int) -> None:
    table = Table(title=f"{name}: {MODELS[name][1]}",
                  caption=f"2 gloo ranks, 1 thread each, 4 stages, {MICROBATCHES} microbatches; "
                          f"medians of {rounds} alternating rounds of {steps} steps")  # fmt: skip
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), help="one model (default: both)")
    parser.add_argument("--steps", type=int, default=3, help="steps per round and runtime")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    names = [args.model] if args.model else list(MODELS)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), names, args.steps, args.rounds, out),
                 nprocs=2, join=True)  # fmt: skip
        with open(out) as f:
            per_rank = json.load(f)
    summaries = {name: summarize([r[name] for r in per_rank]) for name in names}
    for name, summary in summaries.items():
        print_table(name, summary, args.steps, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
