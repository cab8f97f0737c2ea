"""The torchrun worker of the multi-host tests and benchmark (tests/netns_hosts.py starts it).

    torchrun --nnodes 2 --nproc-per-node 2 ... tests/multihost_worker.py --out DIR
        [--schedules 1f1b,pipedream] [--steps 6] [--cluster 2@10GB/s,2@100Mbit/s]
        [--checkpoint-dir DIR --checkpoint-every 2] [--pause-after 1f1b:K] [--boundary-repeats R]

Every rank compiles the same MLP (a 16-feature bottleneck between wide layers) for the cluster,
rank 0 plans it (analytic costs), and trains on the batch of each step index (`batch(step)`),
from `pipe.steps` on (a resumed job skips the batches done). Per schedule it writes its
parameters (`<schedule>-rank<r>.pt`), and per process one report, `report-rank<r>-<pid>.json`:
host, rank, restart count, per schedule the plan (rank 0), the first step run, losses, step
seconds; on a pdcompile error its type, message and wall-clock time, and exit code 1.
`--pause-after SCHEDULE:K`: after step K of that schedule every rank writes `paused-rank<r>` and
waits for the file `go` (the test cuts the link or kills a host meanwhile); K = `--steps`: after
writing the parameters, then one step more. `--boundary-repeats R`: afterwards, the
two ranks on either side of the link time R round trips of the stage boundary's message.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile.errors import PdcompileError
from pdcompile.runtime import wire

WIDTHS = (64, 512, 512, 512, 16, 512, 512, 512, 10)
ROWS, MICROBATCHES = 16, 4  # rows per step, microbatches per step
PAUSE_S = 60.0  # the longest a paused rank waits for `go`
OPTIMIZER = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731


def model() -> nn.Module:
    """The MLP, with the same weights on every call."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).train()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of train step `step`: the same on every rank and in the references."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(ROWS, WIDTHS[0], generator=generator)
    return x, torch.randint(0, WIDTHS[-1], (ROWS,), generator=generator)


def example() -> torch.Tensor:
    """One microbatch: what the plan is priced for."""
    return batch(0)[0][: ROWS // MICROBATCHES]


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
    args = parser.parse_args()
    torch.set_num_threads(1)
    out, rank = Path(args.out), int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    report = {"host": os.environ.get("PDCOMPILE_TEST_HOST"), "rank": rank, "pid": os.getpid(),
              "restart": restart, "runs": {}}  # fmt: skip
    path = out / f"report-rank{rank}-{os.getpid()}.json"
    try:
        for schedule in args.schedules.split(","):
            run(schedule, args, out, rank, report["runs"].setdefault(schedule, {}))
        if args.boundary_repeats:
            report["boundary_s"] = boundary(report["runs"], args.boundary_repeats, rank)
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
        model(), (example(),), loss_fn=F.cross_entropy, optimizer=OPTIMIZER,
        cluster=args.cluster, schedule=schedule, num_microbatches=MICROBATCHES, profile=False,
        timeout=args.timeout, startup_timeout=60, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
    )  # fmt: skip
    record.update(plan=pipe.plan.to_json() if rank == 0 else None, stage=pipe.stage,
                  first_step=pipe.steps, resumed_from=pipe.resumed_from, losses=[],
                  step_s=[])  # fmt: skip
    pause_at = {int(k): s for s, k in [args.pause_after.split(":")]} if args.pause_after else {}
    for step in range(pipe.steps, args.steps):  # a resumed job starts at its checkpoint's step
        start = time.perf_counter()
        record["losses"].append(pipe.train_step(*batch(step)))
        record["step_s"].append(time.perf_counter() - start)
        if pause_at.get(pipe.steps) == schedule and pipe.steps < args.steps:
            pause(out, rank)
    state = {n: t.detach().clone() for n, t in pipe.state_dict().items()}
    torch.save(state, out / f"{schedule}-rank{rank}.pt")
    if pause_at.get(args.steps) == schedule:
        pause(out, rank)
        pipe.train_step(*batch(args.steps))


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


def boundary(runs: dict, repeats: int, rank: int) -> list[float] | None:
    """Seconds per one-way transfer of the first schedule's host-crossing boundary message:
    rank 1 sends it to rank 2, which answers with one byte; rank 1 times each round trip."""
    shared = [next(iter(runs.values()))["plan"]]  # rank 0's
    dist.broadcast_object_list(shared, src=0)
    plan = pdcompile.Plan.from_json(shared[0])
    program = pdcompile.codegen(pdcompile.trace(model(), (example(),)), plan)
    nbytes = crossing_bytes(program, ROWS // MICROBATCHES)
    dist.barrier()
    if rank not in (1, 2):
        return None
    message, ack = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):  # the first one opens the connection
        start = time.perf_counter()
        if rank == 1:
            dist.send(message, 2)
            dist.recv(ack, 2)
        else:
            dist.recv(message, 1)
            dist.send(ack, 1)
        times.append(time.perf_counter() - start)
    return times[1:] if rank == 1 else None


def crossing_bytes(program: pdcompile.StagedProgram, rows: int) -> int:
    """Bytes of the message the stage of rank 1 sends the stage of rank 2 per microbatch of
    `rows` rows (the wire format's layout: its values and header)."""
    stages = program.plan.stages
    channels = tuple(
        c for c in program.channels
        if stages[c.src_stage].ranks == (1,) and stages[c.dst_stage].ranks == (2,)
    )  # fmt: skip
    return wire.layout(channels, rows).size


if __name__ == "__main__":
    main()
