"""Two hosts on this machine over a shaped link: a stage boundary's transfer and the step time
against the cluster's prediction, and the plan with and without the slow link.

    python benchmarks/multihost.py [--rates 200Mbit/s,100Mbit/s,50Mbit/s] [--steps 8] [--repeats 20]

Root only: two network namespaces joined by a veth pair shaped with tc `tbf`
(tests/netns_hosts.py, docs/multihost.md). The MLP of tests/multihost_worker.py, 1024 wide with
a 256-feature bottleneck, 512 rows per step in 4 microbatches, is profiled here once (one
thread); for each link rate the cluster is "2@10GB/s,2@<rate>" and `plan` runs with and
without the slow level ("4@10GB/s"). When the plan for the slow link uses all 4 ranks, the job
runs under `torchrun --nnodes 2 --nproc-per-node 2` across the link (`compile` plans with the
same costs), and ranks 1 and 2 then time round trips of the host-crossing boundary's message
(answered with one byte; one-way = the message's round trip less half a one-byte round trip).
Predicted transfer: the cluster's latency plus the boundary's tensor bytes over the link's
bandwidth, what the planner and the simulator charge. The link also carries TCP/IP headers
(about 4.5% of a full segment) and the message's own header.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile import Cluster, Plan
from pdcompile.core.cluster import parse_bytes
from pdcompile.core.text import human_bytes, human_seconds

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))  # the harness and the worker the tests use

from multihost_worker import Shape, example, model  # noqa: E402
from netns_hosts import TwoHosts, unavailable  # noqa: E402

SHAPE = Shape(width=1024, bottleneck=256, rows=512)
FAST = "10GB/s"  # within a host


def stages(plan: Plan) -> str:
    """`ranks 0-1: input_1.._6 | ranks 2-3: _7..output`."""
    parts = []
    for s in plan.stages:
        ranks = f"{s.ranks[0]}-{s.ranks[-1]}" if len(s.ranks) > 1 else str(s.ranks[0])
        parts.append(f"{ranks}: {s.nodes[0]}..{s.nodes[-1]}")
    return " | ".join(parts)


def run_job(cluster: str, rate: float, costs: str, steps: int, repeats: int, out: Path) -> dict:
    """The job on two hosts with the link shaped to `rate` bytes/s: rank 0's and rank 1's
    reports and the bytes each host sent."""
    worker = str(TESTS / "multihost_worker.py")
    args = ["--out", str(out), "--cluster", cluster, "--steps", str(steps), "--costs", costs,
            "--shape", f"{SHAPE.width},{SHAPE.bottleneck},{SHAPE.rows}", "--timeout", "120",
            "--boundary-repeats", str(repeats)]  # fmt: skip
    with TwoHosts() as hosts:
        hosts.shape(rate)
        agents = [hosts.torchrun(h, worker, args, log=out / f"{h}.log") for h in "ab"]
        deadline = time.monotonic() + 540
        while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
            time.sleep(0.2)
        sent = {h: hosts.tx_bytes(h) for h in "ab"}
        if any(a.returncode != 0 for a in agents):
            logs = "\n".join((out / f"{h}.log").read_text()[-3000:] for h in "ab")
            raise SystemExit(f"the job failed ({[a.returncode for a in agents]}):\n{logs}")
    reports = {}
    for path in out.glob("report-*.json"):
        report = json.loads(path.read_text())
        reports[report["rank"]] = report
    return {"reports": reports, "sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="200Mbit/s,100Mbit/s,50Mbit/s",
                        help="link rates, comma-separated")  # fmt: skip
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if reason := unavailable():
        raise SystemExit(f"cannot make two hosts here: {reason}")
    torch.set_num_threads(1)
    gm = pdcompile.trace(model(SHAPE), (example(SHAPE),))
    graph = pdcompile.analyze(gm, (example(SHAPE),), profile=True)
    flat = pdcompile.plan(graph, f"4@{FAST}", num_microbatches=4)
    table = Table(title=f"two hosts over a tbf-shaped veth pair: MLP {SHAPE}, 4 microbatches, "
                  "1f1b; the shared 2-core VM runs all 4 ranks")  # fmt: skip
    for column in ("link", "boundary message", "transfer predicted", "measured", "ratio",
                   "step predicted", "measured", "link bytes A->B / B->A"):  # fmt: skip
        table.add_column(column, justify="right")
    plans = [f"without the slow link (4@{FAST}): {stages(flat)}"]
    with tempfile.TemporaryDirectory(prefix="pdcompile-multihost-") as tmp:
        costs = str(Path(tmp) / "costs.json")
        graph.save(costs)
        for text in args.rates.split(","):
            rate = parse_bytes(text.strip().removesuffix("/s"), "rate")
            cluster = f"2@{FAST},2@{text.strip()}"
            planned = pdcompile.plan(graph, cluster, num_microbatches=4)
            plans.append(f"with {cluster}: {stages(planned)}")
            if planned.num_devices_used != 4:
                table.add_row(text, *["-"] * 6, f"not run: the plan uses "
                              f"{planned.num_devices_used} of the 4 ranks")  # fmt: skip
                continue
            out = Path(tmp) / text.replace("/", "_")
            out.mkdir()
            job = run_job(cluster, rate, costs, args.steps, args.repeats, out)
            table.add_row(text, *describe(job, Cluster.parse(cluster)))
    Console(width=200).print(table)
    for line in plans:
        print(line)


def describe(job: dict, cluster: Cluster) -> list[str]:
    """The table's cells of one job: the boundary's bytes, its transfer predicted and measured,
    the step predicted and measured (median after the first), the bytes each host sent over
    the whole job (start-up and the round trips included)."""
    boundary = job["reports"][1]["boundary"]
    predicted = cluster.latency(1, 2) + boundary["cut"] / cluster.bandwidth(1, 2)
    measured = statistics.median(boundary["message"]) - statistics.median(boundary["byte"]) / 2
    run = job["reports"][0]["runs"]["1f1b"]
    plan = Plan.from_json(run["plan"])
    step = statistics.median(run["step_s"][1:])
    sent = " / ".join(human_bytes(b) for b in job["sent"].values())
    return [
        f"{boundary['cut']} B + {boundary['wire'] - boundary['cut']} B header",
        human_seconds(predicted), human_seconds(measured), f"{measured / predicted:.2f}",
        human_seconds(plan.step_time), human_seconds(step), sent,
    ]  # fmt: skip


if __name__ == "__main__":
    main()
