"""Soak run: a GPT-style decoder on 3 ranks, checkpointed, a rank killed, then resumed.

    python benchmarks/soak.py [--minibatches 2000] [--every 200] [--schedules 1f1b gpipe
        pipedream 2bw] [--seed 0] [--timeout 20] [--sample-every 10] [--deadline 5400]
        [--backend gloo|nccl] [--json out.json]

For each schedule, three launches of 3 ranks (spawned processes, one thread each, meeting through
a `FileStore`; gloo, or NCCL where CUDA is available, which needs a GPU per rank), all training
the same model on the same data (each minibatch is drawn from its index, so any run sees the same
minibatch at the same index):
1. uninterrupted: `--minibatches` minibatches with a save every `--every` (a save flushes), the
   memory of each rank sampled every `--sample-every` minibatches;
2. interrupted: the same, but one rank, drawn with `--seed`, SIGKILLs itself part-way through a
   random minibatch; the other ranks must stop with `PipelineTimeoutError` (step timeout
   `--timeout` seconds);
3. resumed: all 3 ranks load the last complete checkpoint (read and verified through its
   manifest) and train to the end, saving at the same minibatches.
The final parameters of 1 and 3 must be exactly equal (`torch.equal`, every tensor of every
rank, and the final checkpoints read back whole), and so must the losses logged after the resume.
A minibatch is one update of every stage: a `train_step` of 4 microbatches for `1f1b`, `gpipe`
and `2bw`, and one PipeDream minibatch for `pipedream` (a `train_step` of 1 microbatch). Under
`pipedream` and `2bw` minibatches stay in flight across steps until a save flushes them.

Memory: the resident set size (RSS, `/proc/self/statm`) of each rank, or on CUDA the allocated
bytes, sampled in the uninterrupted run. The log of actions `PipelinedModule` keeps for
`explain()` is cleared at each sample (`--action-log` keeps it): it is a buffer of up to 50,000
actions per rank, about 285 bytes each here (14 MiB), that grows for the first 1,900-6,300
minibatches and would hide a leak. Growth is the largest sample of the second half of the steady
state (after the first save) minus the largest of its first quarter; the late slope is a
least-squares fit over that second half; flat means growth of at most `--flat` bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import resource
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile import zoo
from pdcompile.runtime import manifest
from pdcompile.runtime.distributed import init_process_group

SCHEDULES = ("1f1b", "gpipe", "pipedream", "2bw")
WORLD_SIZE = 3
ROWS = 8  # rows per minibatch
MICROBATCHES = 4  # per minibatch, except pipedream (1: a train_step is a PipeDream minibatch)
CONFIG = zoo.GPTConfig(vocab_size=64, block_size=32, n_layer=3, n_head=4, n_embd=64, dropout=0.1)
WARMUP = 100  # updates of linear learning-rate warm-up


@dataclasses.dataclass(frozen=True)
class Kill:
    """Rank `rank` SIGKILLs itself `fraction` of a median minibatch into minibatch `minibatch`."""

    rank: int
    minibatch: int
    fraction: float


@dataclasses.dataclass(frozen=True)
class Job:
    """One launch of the ranks: what to train, where to save, whom to kill, where to resume."""

    schedule: str
    minibatches: int
    every: int
    sample_every: int
    timeout_s: float
    seed: int
    checkpoints: str  # folder of the step-NNNNNN checkpoints
    results: str  # folder of the ranks' reports
    action_log: bool = False  # keep PipelinedModule's log of actions (else cleared per sample)
    backend: str | None = None  # None: NCCL when CUDA is available (a GPU per rank), else gloo
    kill: Kill | None = None
    resume_from: str | None = None


def batch(seed: int, minibatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Minibatch `minibatch`'s tokens and targets: arithmetic sequences mod the vocabulary (a
    learnable next token), drawn from the index alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + minibatch)
    start = torch.randint(0, CONFIG.vocab_size, (ROWS, 1), generator=g)
    stride = torch.randint(1, 5, (ROWS, 1), generator=g)
    seq = (start + stride * torch.arange(CONFIG.block_size + 1)) % CONFIG.vocab_size  # [B, T+1]
    return seq[:, :-1], seq[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # [B*T, V] against [B*T]


def build(job: Job) -> Any:
    """The compiled pipeline of this rank (the same model, seed and plan in every launch)."""
    torch.manual_seed(job.seed)
    model = zoo.GPT(CONFIG).train()
    x, _ = batch(job.seed, 0)
    return pdcompile.compile(
        model, (x,), loss_fn=loss_fn, schedule=job.schedule, solver="uniform", profile=False,
        num_microbatches=1 if job.schedule == "pipedream" else MICROBATCHES,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda u: min(1.0, (u + 1) / WARMUP)
        ),
        # pipedream: per stage, the two stages holding the tied embedding together
        clip_grad_norm=1.0, timeout=job.timeout_s,
    )  # fmt: skip


def memory_sample(device: torch.device) -> tuple[int, int | None]:
    """(RSS bytes from /proc/self/statm, else the peak from getrusage; CUDA allocated bytes)."""
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        rss = peak_rss()
    cuda = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    return rss, cuda


def peak_rss() -> int:
    """The process's peak RSS in bytes (getrusage reports KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _rank(rank: int, job: Job, init_file: str) -> None:
    """A rank's process: train `job`, write its report (and state dict) to `job.results`."""
    torch.set_num_threads(1)
    report: dict[str, Any] = {"rank": rank, "error": None, "memory": [], "losses": {}}
    try:
        device = init_process_group(rank, WORLD_SIZE, init_file=init_file, backend=job.backend,
                                    timeout_s=job.timeout_s)  # fmt: skip
        report["device"] = str(device)
        _train(rank, job, device, report)
    except Exception as exc:  # a survivor's error is the finding: report it, then leave
        report.update(error=f"{type(exc).__name__}: {exc}", error_type=type(exc).__name__,
                      error_at=time.time())  # fmt: skip
    report["peak_rss"] = peak_rss()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        report["peak_cuda"] = torch.cuda.max_memory_allocated()
    path = os.path.join(job.results, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)
    if report["error"] is None:
        dist.destroy_process_group()
    else:  # a group with a dead peer cannot be torn down cleanly
        os._exit(1)


def _train(rank: int, job: Job, device: torch.device, report: dict[str, Any]) -> None:
    pipe = build(job)
    if job.resume_from:
        pipe.load(job.resume_from)
    report["started_at"] = first = pipe.steps  # minibatches done before this launch
    seconds: list[float] = []
    for minibatch in range(first, job.minibatches):
        if job.kill and job.kill.rank == rank and job.kill.minibatch == minibatch:
            delay = job.kill.fraction * (statistics.median(seconds) if seconds else 0.0)
            _kill_after(delay, os.path.join(job.results, "killed_at"))
        start = time.perf_counter()
        x, y = batch(job.seed, minibatch)
        loss = pipe.train_step(x, y)
        seconds.append(time.perf_counter() - start)
        done = minibatch + 1
        if done % job.sample_every == 0:
            log = [w.timeline for w in pipe.pipeline.workers.values()]
            report["memory"].append((done, *memory_sample(device), sum(map(len, log))))
            report["losses"][done] = loss
            if not job.action_log:
                for actions in log:
                    actions.clear()
        if done % job.every == 0:
            pipe.save(os.path.join(job.checkpoints, f"step-{done:06d}"))
    if job.kill and job.kill.rank == rank:  # the timer has not fired: the kill must happen
        _kill_after(0.0, os.path.join(job.results, "killed_at"))
        time.sleep(60)
    torch.save(pipe.state_dict(), os.path.join(job.results, f"rank{rank}.pt"))


def _kill_after(delay: float, stamp: str) -> None:
    """SIGKILL this process in `delay` seconds, writing the time to `stamp` just before."""

    def kill() -> None:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    timer = threading.Timer(delay, kill)
    timer.daemon = True
    timer.start()


def launch(job: Job, deadline: float, grace_s: float) -> list[dict[str, Any]]:
    """Run `job` on 3 spawned ranks; returns each rank's report (a rank that died or was killed
    for running past `deadline`, or `grace_s` after another rank died, has only `error`)."""
    os.makedirs(job.results, exist_ok=True)
    ctx = mp.get_context("spawn")
    init_file = os.path.join(job.results, "store")
    processes = [
        ctx.Process(target=_rank, args=(rank, job, init_file), name=f"soak-rank{rank}")
        for rank in range(WORLD_SIZE)
    ]
    for process in processes:
        process.start()
    first_death: float | None = None
    late: set[int] = set()
    while any(p.is_alive() for p in processes):
        now = time.monotonic()
        dead = [p for p in processes if not p.is_alive() and p.exitcode != 0]
        if dead and first_death is None:
            first_death = now
        limit = deadline if first_death is None else min(deadline, first_death + grace_s)
        if now > limit:
            for rank, process in enumerate(processes):
                if process.is_alive():
                    process.kill()  # a straggler: the soak must never hang
                    late.add(rank)
            break
        time.sleep(0.2)
    reports = []
    for rank, process in enumerate(processes):
        process.join(timeout=10)
        path = os.path.join(job.results, f"rank{rank}.json")
        if rank in late:
            reports.append({"rank": rank, "error": "hung: killed by the soak's time limit"})
        elif os.path.exists(path):
            with open(path) as f:
                reports.append(json.load(f))
        else:
            reports.append({"rank": rank, "error": f"died (exit code {process.exitcode})"})
    return reports


def last_checkpoint(folder: str) -> tuple[str | None, list[str]]:
    """The newest checkpoint in `folder` whose manifest reads and whose files verify, and what
    else is there (what an interrupted save left, newer checkpoints that do not verify)."""
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    leftovers = [n for n in names if not re.fullmatch(r"step-\d{6}", n)]
    for name in reversed([n for n in names if n not in leftovers]):
        path = os.path.join(folder, name)
        try:
            problems = manifest.verify(path, manifest.read(path))
        except pdcompile.PdcompileError as exc:
            problems = [str(exc)]
        if not problems:
            return path, leftovers
        leftovers.append(name)
    return None, leftovers


def compare(first: str, second: str) -> tuple[bool, float, list[str]]:
    """Whether the ranks' final state dicts (and the final checkpoints) in two result folders
    are equal: (equal, largest absolute difference, names that differ)."""
    pairs = []
    for rank in range(WORLD_SIZE):
        a, b = (torch.load(os.path.join(d, f"rank{rank}.pt"), map_location="cpu")
                for d in (first, second))  # fmt: skip
        if a.keys() != b.keys():
            return False, math.inf, [f"rank {rank}: names {sorted(a.keys() ^ b.keys())}"]
        pairs += [(f"rank {rank}: {n}", a[n], b[n]) for n in a]
    differ, largest = [], 0.0
    for name, a, b in pairs:
        if not torch.equal(a, b):
            differ.append(name)
        if a.is_floating_point():
            largest = max(largest, float((a.double() - b.double()).abs().max()))
    return not differ, largest, differ


def memory_summary(samples: list[list[Any]], every: int, peak: int) -> dict[str, Any]:
    """Peak, steady-state growth and late slope (bytes per 1,000 minibatches) of one rank's
    samples (minibatch, RSS, CUDA bytes, actions logged); the steady state starts after the
    first save."""
    cuda = bool(samples) and all(s[2] is not None for s in samples)
    measure = 2 if cuda else 1
    steady = [(s[0], s[measure]) for s in samples if s[0] > every]
    # Linux updates getrusage's high-water mark lazily: a sample may lie above it
    peak = max([peak, *(s[measure] for s in samples)])
    out: dict[str, Any] = {
        "measure": "cuda allocated" if cuda else "rss", "peak": peak,
        "steady_max": max((b for _, b in steady), default=None), "growth": None,
        "slope_per_1000": None, "actions_logged": max((s[3] for s in samples), default=0),
    }  # fmt: skip
    if len(steady) >= 4:
        quarter, half = steady[: len(steady) // 4], steady[len(steady) // 2 :]
        out["growth"] = max(b for _, b in half) - max(b for _, b in quarter)
        steps, values = np.array(half, dtype=np.float64).T
        out["slope_per_1000"] = float(np.polyfit(steps, values, 1)[0] * 1000)
    return out


def survivors(reports: list[dict[str, Any]], kill: Kill, folder: str) -> dict[int, dict]:
    """How each rank but the killed one ended: its error, type and seconds after the kill."""
    stamp = os.path.join(folder, "killed_at")
    killed_at = None
    if os.path.exists(stamp):
        with open(stamp) as f:
            killed_at = float(f.read())
    out = {}
    for r in reports:
        if r["rank"] != kill.rank:
            after = r.get("error_at", math.nan) - (killed_at or math.nan)
            out[r["rank"]] = {"type": r.get("error_type"), "error": r["error"], "after_s": after}
    return out


def stopped_by_timeout(survivor: dict[str, Any]) -> bool:
    """A PipelineTimeoutError, or a StageCommError relaying a peer's PipelineTimeoutError."""
    relayed = survivor["type"] == "StageCommError" and "PipelineTimeoutError" in survivor["error"]
    return survivor["type"] == "PipelineTimeoutError" or relayed


def soak(schedule: str, args: argparse.Namespace, root: str, deadline: float) -> dict[str, Any]:
    """The three launches of one schedule and their comparison."""
    draw = random.Random(f"{args.seed}/{schedule}")
    kill = Kill(draw.randrange(WORLD_SIZE), draw.randrange(args.every, args.minibatches - 1),
                round(draw.random(), 3))  # fmt: skip
    folder = os.path.join(root, schedule)
    checkpoints = {n: os.path.join(folder, f"{n}-ckpt") for n in ("uninterrupted", "interrupted")}
    wall: dict[str, float] = {}

    def run(name: str, ckpt: str, **job: Any) -> list[dict[str, Any]]:
        start = time.monotonic()
        spec = Job(schedule=schedule, minibatches=args.minibatches, every=args.every,
                   sample_every=args.sample_every, timeout_s=args.timeout, seed=args.seed,
                   checkpoints=ckpt, results=os.path.join(folder, name),
                   action_log=args.action_log, backend=args.backend, **job)  # fmt: skip
        reports = launch(spec, deadline, grace_s=2 * args.timeout + 60)
        wall[name] = time.monotonic() - start
        return reports

    whole = run("uninterrupted", checkpoints["uninterrupted"])
    cut = run("interrupted", checkpoints["interrupted"], kill=kill)
    resume_from, leftovers = last_checkpoint(checkpoints["interrupted"])
    resumed = run("resumed", checkpoints["interrupted"], resume_from=resume_from)
    stopped = survivors(cut, kill, os.path.join(folder, "interrupted"))
    result: dict[str, Any] = {
        "schedule": schedule, "kill": dataclasses.asdict(kill), "victim": cut[kill.rank]["error"],
        "survivors": stopped, "survivors_timed_out": all(map(stopped_by_timeout,
                                                             stopped.values())),
        "resumed_from": manifest.read(resume_from).step if resume_from else 0,
        "leftovers": leftovers, "wall_s": wall,
        "errors": {f"{name} rank {r['rank']}": r["error"]
                   for name, reports in (("uninterrupted", whole), ("resumed", resumed))
                   for r in reports if r["error"]},
        "memory": {r["rank"]: memory_summary(r.get("memory", []), args.every,
                                             r.get("peak_cuda", r.get("peak_rss", 0)))
                   for r in whole},
    }  # fmt: skip
    result.update(equal=False, max_diff=math.nan, differ=[])
    if not result["errors"]:
        equal, largest, differ = compare(os.path.join(folder, "uninterrupted"),
                                         os.path.join(folder, "resumed"))  # fmt: skip
        final = f"step-{args.minibatches:06d}"
        a, b = (pdcompile.load_full_state_dict(os.path.join(c, final))
                for c in checkpoints.values())  # fmt: skip
        same_files = a.keys() == b.keys() and all(torch.equal(t, b[n]) for n, t in a.items())
        after = resumed[0]["losses"]  # JSON: minibatch (a string) -> loss, logged after resuming
        same_losses = all(whole[0]["losses"][k] == loss for k, loss in after.items())
        result.update(equal=equal and same_files and same_losses, max_diff=largest,
                      differ=differ[:10], checkpoints_equal=same_files,
                      losses_equal=same_losses, losses_compared=len(after),
                      final_loss=whole[0]["losses"].get(str(args.minibatches)))  # fmt: skip
    growth = [m["growth"] for m in result["memory"].values()]
    # too few samples to tell: None
    result["flat"] = None if None in growth else all(g <= args.flat for g in growth)
    return result


def _per_rank(memory: dict[int, dict[str, Any]], key: str) -> str:
    values = [memory[rank][key] for rank in sorted(memory)]
    return " / ".join("-" if v is None else f"{v / 2**20:.1f}" for v in values)


def _stop(survivor: dict[str, Any]) -> str:
    if survivor["type"] is None:
        return "finished"
    if stopped_by_timeout(survivor):
        return "relayed timeout" if survivor["type"] == "StageCommError" else "timeout"
    return survivor["type"]


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> Table:
    log = "kept" if args.action_log else "cleared at each sample"
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    out = Table(title=f"soak: {WORLD_SIZE} {backend} ranks, {args.minibatches} minibatches, a save "
                f"every {args.every}, seed {args.seed}; memory (RSS; CUDA allocated on GPUs) "
                f"in MiB for ranks 0 / 1 / 2, action log {log}")  # fmt: skip
    columns = ("schedule", "killed rank @ minibatch", "resumed from",
               "survivors stopped (after the kill)", "equal", "max |diff|", "peak",
               "steady growth", "late slope / 1000 minibatches", "flat",
               "wall s (whole, cut, resumed)")  # fmt: skip
    for column in columns:
        out.add_column(column, justify="left" if column.startswith("surv") else "right")
    for r in results:
        kill, memory = r["kill"], r["memory"]
        stops = [f"{_stop(s)} {s['after_s']:.1f} s" for s in r["survivors"].values()]
        out.add_row(
            r["schedule"],
            f"{kill['rank']} @ {kill['minibatch']} +{kill['fraction']:.2f}",
            str(r["resumed_from"]),
            ", ".join(stops),
            "yes" if r["equal"] else "NO",
            f"{r['max_diff']:.3g}",
            _per_rank(memory, "peak"),
            _per_rank(memory, "growth"),
            _per_rank(memory, "slope_per_1000"),
            {True: "yes", False: "NO", None: "-"}[r["flat"]],
            ", ".join(f"{s:.0f}" for s in r["wall_s"].values()),
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minibatches", type=int, default=2000)
    parser.add_argument("--every", type=int, default=200, help="minibatches between saves")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--seed", type=int, default=0, help="draws the killed rank and step")
    parser.add_argument("--timeout", type=float, default=20.0, help="step timeout (seconds)")
    parser.add_argument("--sample-every", type=int, default=10, help="minibatches per sample")
    parser.add_argument("--flat", type=float, default=2 * 2**20, help="growth bytes called flat")
    parser.add_argument("--action-log", action="store_true",
                        help="keep the actions PipelinedModule logs for explain() (a buffer of "
                        "50,000 per rank) instead of clearing them at each sample")  # fmt: skip
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        help="default: nccl when CUDA is available (3 GPUs), else gloo",
    )
    parser.add_argument("--deadline", type=float, default=5400.0, help="overall limit (s)")
    parser.add_argument("--workdir", help="keep checkpoints and reports here (else a temp dir)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if not 0 < args.every < args.minibatches - 1 or args.minibatches % args.every:
        parser.error("--every must divide --minibatches and leave a minibatch after the first save")
    deadline = time.monotonic() + args.deadline
    console = Console(width=max(Console().width, 160))
    console.print(f"soak: seed {args.seed}, schedules {' '.join(args.schedules)}")
    results = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdcompile-soak-") as tmp:
        for schedule in args.schedules:
            r = soak(schedule, args, args.workdir or tmp, deadline)
            results.append(r)
            console.print(f"{schedule}: equal {r['equal']}, flat {r['flat']}, wall "
                          f"{sum(r['wall_s'].values()):.0f} s", markup=False)  # fmt: skip
    total = time.monotonic() - start
    console.print(table(results, args))
    console.print(f"total wall time {total:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "wall_s": total, "results": results}, f, indent=1)
    return 0 if all(r["equal"] and r["survivors_timed_out"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
