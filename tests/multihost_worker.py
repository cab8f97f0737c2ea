"""The torchrun worker of the multi-host tests and benchmark (tests/netns_hosts.py starts it).

    torchrun --nnodes 2 --nproc-per-node 2 ... tests/multihost_worker.py --out DIR
        [--schedules 1f1b,pipedream] [--steps 6] [--cluster 2@10GB/s,2@100Mbit/s]
        [--checkpoint-dir DIR --checkpoint-every 2] [--pause-after 1f1b:K]
        [--shape WIDTH,BOTTLENECK,ROWS] [--costs COSTS.json] [--boundary-repeats R]

Every rank compiles the same MLP (`Shape`: a bottleneck between wide layers) for the cluster,
rank 0 plans it (analytic costs, or those of `--costs`), and trains on the batch of each
step index (`batch(step)`), from `pipe.steps` on (a resumed job skips the batches done). Per
schedule it writes its parameters (`<schedule>-rank<r>.pt`), and per process one report,
`report-rank<r>-<pid>.json`: host, rank, restart count, per schedule the plan, the first step
run, losses, step seconds; on a pdcompile error its type, message and wall-clock time, and exit
code 1. `--pause-after SCHEDULE:K`: after step K of that schedule every rank writes
`paused-rank<r>` and waits for the file `go` (the test cuts the link or kills a host
meanwhile); K = `--steps`: after writing the parameters, then one step more.
`--boundary-repeats R`: afterwards ranks 1 and 2 time round trips of the host-crossing stage
boundary's message (`boundary`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile.core.errors import PdcompileError
from pdcompile.runtime import wire

ROWS, MICROBATCHES = 16, 4  # rows per step, microbatches per step
PAUSE_S = 60.0  # the longest a paused rank waits for `go`
OPTIMIZER = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731


@dataclass(frozen=True)
class Shape:
    """The MLP: 64 inputs, three `width` layers, a `bottleneck`, three `width` layers, 10
    classes; `rows` per train step."""

    width: int = 512
    bottleneck: int = 16
    rows: int = ROWS

    @property
    def widths(self) -> tuple[int, ...]:
        return (64, *[self.width] * 3, self.bottleneck, *[self.width] * 3, 10)


def model(shape: Shape = Shape()) -> nn.Module:
    """The MLP, with the same weights on every call."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(shape.widths, shape.widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).train()


def batch(step: int, shape: Shape = Shape()) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of train step `step`: the same on every rank and in the references."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(shape.rows, shape.widths[0], generator=generator)
    return x, torch.randint(0, shape.widths[-1], (shape.rows,), generator=generator)


def example(shape: Shape = Shape()) -> torch.Tensor:
    """One microbatch: what the plan is priced for."""
    return batch(0, shape)[0][: shape.rows // MICROBATCHES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--schedules", default="1f1b")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cluster", default="2@10GB/s,2@100Mbit/s")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int)
    parser.add_argument("--pause-after", help="SCHEDULE:STEP")
    parser.add_argument("--boundary-repeats", type=int, default=0)
    parser.add_argument("--shape", default="512,16,16", help="WIDTH,BOTTLENECK,ROWS")
    parser.add_argument("--costs", help="a CostGraph JSON to plan with (else analytic costs)")
    args = parser.parse_args()
    args.shape = Shape(*map(int, args.shape.split(",")))
    torch.set_num_threads(1)
    # torchrun's agent SIGTERMs a host's other ranks once one fails; each rank's own wait ends
    # within the step timeout anyway, so it finishes and writes its report first
    signal.signal(signal.SIGTERM, lambda *_: None)
    out, rank = Path(args.out), int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    report = {"host": os.environ.get("PDCOMPILE_TEST_HOST"), "rank": rank, "pid": os.getpid(),
              "restart": restart, "runs": {}}  # fmt: skip
    path = out / f"report-rank{rank}-{os.getpid()}.json"
    try:
        for schedule in args.schedules.split(","):
            run(schedule, args, out, rank, report["runs"].setdefault(schedule, {}))
        if args.boundary_repeats:
            plan = pdcompile.Plan.from_json(next(iter(report["runs"].values()))["plan"])
            report["boundary"] = boundary(plan, args.shape, args.boundary_repeats, rank)
        dist.barrier()
    except PdcompileError as exc:
        report["error"] = {"type": type(exc).__name__, "message": str(exc), "time": time.time()}
        write(path, report)
        raise SystemExit(1) from exc
    write(path, report)
    dist.destroy_process_group()


def run(schedule: str, args: argparse.Namespace, out: Path, rank: int, record: dict) -> None:
    """Compile, train from `pipe.steps` to `args.steps` (filling `record` as it goes), write
    this rank's parameters; then pause and train one step more where `--pause-after` says."""
    pipe = pdcompile.compile(
        model(args.shape), (example(args.shape),), loss_fn=F.cross_entropy,
        optimizer=OPTIMIZER, cluster=args.cluster, schedule=schedule,
        num_microbatches=MICROBATCHES, profile=False, costs=args.costs,
        timeout=args.timeout, startup_timeout=60, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
    )  # fmt: skip
    record.update(plan=pipe.plan.to_json(), stage=pipe.stage,
                  first_step=pipe.steps, resumed_from=pipe.resumed_from, losses=[],
                  step_s=[])  # fmt: skip
    pause_at = {int(k): s for s, k in [args.pause_after.split(":")]} if args.pause_after else {}
    for step in range(pipe.steps, args.steps):  # a resumed job starts at its checkpoint's step
        start = time.perf_counter()
        record["losses"].append(pipe.train_step(*batch(step, args.shape)))
        record["step_s"].append(time.perf_counter() - start)
        if pause_at.get(pipe.steps) == schedule and pipe.steps < args.steps:
            pause(out, rank)
    state = {n: t.detach().clone() for n, t in pipe.state_dict().items()}
    torch.save(state, out / f"{schedule}-rank{rank}.pt")
    if pause_at.get(args.steps) == schedule:
        pause(out, rank)
        pipe.train_step(*batch(args.steps, args.shape))


def write(path: Path, report: dict) -> None:
    """Write `report` whole or not at all (the test polls for it)."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(report))
    os.replace(partial, path)


def pause(out: Path, rank: int) -> None:
    (out / f"paused-rank{rank}").touch()
    deadline = time.monotonic() + PAUSE_S
    while not (out / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def boundary(plan: pdcompile.Plan, shape: Shape, repeats: int, rank: int) -> dict | None:
    """Round trips across the link between ranks 1 and 2 (rank 1 times them): `repeats` of the
    message a stage of host A sends a stage of host B per microbatch, answered with one byte,
    and `repeats` of one byte each way. Returns, on rank 1, the message's bytes (`cut`: the
    tensors' bytes the planner counts; `wire`: with the message's header) and the seconds."""
    program = pdcompile.codegen(pdcompile.trace(model(shape), (example(shape),)), plan)
    rows, stages = shape.rows // MICROBATCHES, plan.stages
    crossing = tuple(
        c for c in program.channels
        if max(stages[c.src_stage].ranks) <= 1 < min(stages[c.dst_stage].ranks)
    )  # fmt: skip
    wire_bytes = wire.layout(crossing, rows).size
    tensors = [c for c in crossing if c.kind == "tensor"]
    cut = sum(math.prod(c.shape_for(rows)) * getattr(torch, c.dtype).itemsize for c in tensors)
    if rank not in (1, 2):
        return None
    seconds = {"message": [], "byte": []}
    for kind, size in (("message", wire_bytes), ("byte", 1)):
        tensor, ack = torch.zeros(size, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
        for _ in range(repeats + 1):  # the first one opens the connection
            start = time.perf_counter()
            if rank == 1:
                dist.send(tensor, 2)
                dist.recv(ack, 2)
            else:
                dist.recv(tensor, 1)
                dist.send(ack, 1)
            seconds[kind].append(time.perf_counter() - start)
    if rank == 2:
        return None
    return {"cut": cut, "wire": wire_bytes, **{k: v[1:] for k, v in seconds.items()}}


if __name__ == "__main__":
    main()
