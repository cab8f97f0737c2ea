"""A rank held to half a CPU: does the measured cluster see it, and does the plan give it less?

    python benchmarks/slow_rank.py [--layers 8] [--width 1024] [--rows 64] [--steps 12]
        [--quota 0.5] [--out benchmarks/results]

Root only (a cgroup CPU quota, tests/cpu_quota.py). `torchrun --standalone --nproc-per-node 2`
runs this file's worker, each rank pinned to its own core (`sched_setaffinity`), one thread;
rank 1 puts itself under the quota before anything else. The worker compiles an MLP of `--layers`
Linear(width, width) + ReLU pairs with `schedule="1f1b"`, 4 microbatches and no `cluster=`, so
the job measures its cluster (`runtime/cluster_measure.py`: rank speeds included) and plans on
it; then it runs the same model on every two-stage cut of the chain that leaves a Linear on each
side (`compile(plan=)`, the stages priced on analytic costs: only their nodes matter here).
Every run trains `--steps` steps after two untimed ones; the table gives the median step.

Reported: the measured speeds, the planned cut and its step, the even cut's step, the best cut
found by trying every one; the ratios even / planned (the issue asks at least 1.3x) and
planned / best (at most 1.1x). Results go to `slow_rank.json` in `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the cgroup helper the tests use


def model(layers: int, width: int):
    import torch

    torch.manual_seed(0)
    parts = []
    for _ in range(layers):
        parts += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*parts, torch.nn.Linear(width, 10))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import pdcompile
    from pdcompile.passes.planning.solver_kit import make_plan

    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % os.cpu_count()})  # a core each
    quota = None
    if rank == 1:
        from cpu_quota import cpu_quota

        quota = cpu_quota(os.getpid(), args.quota)
        quota.__enter__()
    torch.set_num_threads(1)
    x = torch.randn(args.rows, args.width)
    y = torch.randint(0, 10, (args.rows,))
    settings = dict(loss_fn=torch.nn.functional.cross_entropy, schedule="1f1b",
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                    num_microbatches=4)  # fmt: skip
    example = (x[: args.rows // 4],)

    def timed(pipe) -> float:
        seconds = []
        for _ in range(args.steps + 2):
            dist.barrier()
            start = time.perf_counter()
            pipe.train_step(x, y)
            seconds.append(time.perf_counter() - start)
        pipe.close()
        return statistics.median(seconds[2:])

    pipe = pdcompile.compile(model(args.layers, args.width), example, **settings)
    planned, cluster = pipe.plan, pipe.plan.cluster
    results = {"speeds": cluster.speed, "measured": cluster.measured,
               "planned": {"cut": len(planned.stages[0].nodes), "step": timed(pipe),
                           "predicted": planned.step_time}}  # fmt: skip
    nodes = [n for s in planned.stages for n in s.nodes]
    gm = pdcompile.trace(model(args.layers, args.width), example)
    costs = pdcompile.analyze(gm, example, profile=False)
    linear = [i for i, n in enumerate(nodes) if costs.graph.nodes[n]["param_bytes"]]
    cuts = []
    for cut in range(linear[0] + 1, linear[-1] + 1):
        if any(i < cut for i in linear) and any(i >= cut for i in linear):
            plan = make_plan(costs, cluster, [(nodes[:cut], 1), (nodes[cut:], 1)],
                             {"schedule": "1f1b", "num_microbatches": 4}, "cut")  # fmt: skip
            pipe = pdcompile.compile(model(args.layers, args.width), example, plan=plan,
                                     **settings)  # fmt: skip
            cuts.append({"cut": cut, "step": timed(pipe)})
    results["cuts"] = cuts
    if rank == 0:
        Path(args.out, "slow_rank.json").write_text(json.dumps(results, indent=1))
    if quota is not None:
        quota.__exit__(None, None, None)


def report(out: Path, layers: int) -> None:
    from rich.console import Console
    from rich.table import Table

    results = json.loads((out / "slow_rank.json").read_text())
    cuts = {c["cut"]: c["step"] for c in results["cuts"]}
    best = min(cuts, key=cuts.get)
    even = min(cuts, key=lambda c: abs(c - (2 * layers + 1) / 2))  # half the Linears each side
    planned = results["planned"]
    table = Table(title=f"rank 1 at half a CPU: speeds {results['speeds']}")
    for column in ("split", "first stage nodes", "median step", "vs planned"):
        table.add_column(column)
    for name, cut, step in (
        ("planned (measured cluster)", planned["cut"], planned["step"]),
        ("even", even, cuts[even]),
        ("best of every cut", best, cuts[best]),
    ):
        table.add_row(name, str(cut), f"{step * 1e3:.1f} ms", f"{step / planned['step']:.2f}x")
    Console().print(table)
    print(f"even / planned {cuts[even] / planned['step']:.2f}x (>= 1.3 asked); planned / best "
          f"{planned['step'] / cuts[best]:.2f}x (<= 1.1 asked); predicted step "
          f"{planned['predicted'] * 1e3:.1f} ms")  # fmt: skip
    print("every cut:", ", ".join(f"{c}: {s * 1e3:.1f} ms" for c, s in sorted(cuts.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quota", type=float, default=0.5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PDCOMPILE_CACHE_DIR": str(Path(args.out) / "cache")}  # measured afresh  # fmt: skip
    shutil.rmtree(Path(args.out) / "cache", ignore_errors=True)
    subprocess.run([launcher, "--standalone", "--nproc-per-node", "2", __file__, "--worker",
                    *sys.argv[1:]], env=env, check=True)  # fmt: skip
    report(Path(args.out), args.layers)


if __name__ == "__main__":
    main()
