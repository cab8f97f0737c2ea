"""Time to accuracy against torch DDP on two hosts over a link rate sweep (issue 29, part 4).

    python benchmarks/time_to_accuracy.py [--rates 0.5Gbit/s,...,unshaped] [--seeds N] [--quick]
        [--methods ddp,auto,1f1b,pipedream] [--cluster "2@{rate}"] [--out DIR]

Root only. Two hosts are two network namespaces joined by a veth pair (tests/netns_hosts.py),
shaped with tc `tbf` to each rate ("unshaped": no qdisc), one rank per host, each rank pinned
to its own core (`sched_setaffinity` to core RANK before torch starts) at one thread. Per rate
and method a fresh `torchrun --nnodes 2 --nproc-per-node 1` (c10d rendezvous) runs
benchmarks/tta_worker.py, which trains every seed from the same initial weights on the same
batches until the validation accuracy reaches the target. Methods:
- `ddp`: torch DistributedDataParallel, gloo, default buckets, overlap on;
- `auto`: `pdcompile.compile` as a user calls it: no `cluster=`, `schedule="auto"`,
  `global_batch_size=32`;
- `1f1b`, `pipedream`: `compile(schedule=..., num_microbatches=4)`;
- `auto+cluster` (added when `--cluster` is given): `auto` with that cluster.
`--cluster TEMPLATE` is passed to every compile method but `auto`; `{rate}` in it becomes the
shaped rate, and `--unshaped-as` on the unshaped link (e.g. `--cluster "2@{rate}"`).

Reported per rate and method (medians over seeds): training seconds to the target (evaluation
excluded) and with evaluation, samples to the target, samples per second, bytes on the link
during training (both hosts' veth tx counters), the plan with its predicted (`plan.step_time`)
and measured step (median). Then the crossover: the rates where `auto` ran a pipeline or data
parallelism, the rate where the planner switches (bisection on the outer level's bandwidth of
the cluster the last `auto` run used, with costs profiled here: `--no-bisect` skips it), and
where `auto`'s (and `1f1b`'s) time to the target crosses DDP's (log-log interpolation between
the rates; the unshaped link sits at its rate measured by DDP's all-reduce probe). Writes
`results.json`, `table.txt` and `time_to_accuracy.png` (one line per method) to `--out`
(default `out/time_to_accuracy`, git-ignored). `--quick`: 1.25 Gbit/s and unshaped, one seed.
`--merge A/results.json B/results.json ...` runs nothing (no root needed): it joins earlier
runs' rates (a later file's rate replaces an earlier's) into one table, crossover and picture.

The task (benchmarks/tta_worker.py `Task`): an MLP 64-2048-2048-2048-2048-10 (12.7 M parameters,
51 MB of gradients) on scikit-learn's bundled digits (1437 training rows, 360 validation), 32
rows per step (`--rows`, `--width` change it), SGD lr 0.02 momentum 0.9, target 95% validation
accuracy (190 steps, 6080 samples, for DDP and the synchronous schedules). Chosen for data
parallelism's all-reduce against its compute. DDP's probe (the same processes, after a run;
shared 2-core VM, 2026-11-27): its step on 16 rows per rank computes in 38-49 ms on one core,
its gradients' all-reduce alone takes 338 ms at 1.25 Gbit/s (9.0x the compute: the paper's
regime, VGG-16 on 10 Gbit/s) and 40 ms on the unshaped veth (0.8x; 1.27 GB/s, "10.2 Gbit/s").
On a CPU the ratio cannot go much higher at 10 Gbit/s for a dense model: a step reads each
weight several times from memory (forward, both backward products, the optimizer's update),
about as slow per parameter as the all-reduce sends it at 10 Gbit/s; the slow rates are where
the regime holds. A two-stage pipeline sends the 2048-wide activations of 32 rows and their
gradients, 0.53 MB per step against DDP's 102 MB. "link bytes" are the training's (the JSON
also has the evaluations': the pipeline sends the validation rows' activations, 3 MB each).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the two-host harness the tests use

from netns_hosts import TwoHosts, unavailable  # noqa: E402

WORKER = HERE / "tta_worker.py"
RATES = "0.5Gbit/s,1.25Gbit/s,2.5Gbit/s,5Gbit/s,10Gbit/s,unshaped"
QUICK_RATES = "1.25Gbit/s,unshaped"
METHODS = "ddp,auto,1f1b,pipedream"
UNSHAPED = "unshaped"
JOB_S = 1500  # the longest one job (a method at a rate, every seed) may take
_jobs = iter(range(1 << 20))  # a port and rendezvous id per job


def parse_rate(text: str) -> float | None:
    """`"1.25Gbit/s"` -> bytes per second; `"unshaped"` -> None."""
    from pdcompile.core.cluster import parse_bytes

    text = text.strip()
    return None if text == UNSHAPED else parse_bytes(text.removesuffix("/s"), "rate")


def cluster_for(template: str | None, rate: str, unshaped_as: str) -> str | None:
    """The `--cluster` template at this rate."""
    if template is None:
        return None
    return template.replace("{rate}", unshaped_as if rate == UNSHAPED else rate)


def run_job(hosts: TwoHosts, method: str, args: argparse.Namespace, cluster: str | None,
            out: Path) -> dict:  # fmt: skip
    """One method's torchrun on both hosts, every seed: the workers' records by seed and rank,
    and the bytes each host sent over the whole job (start-up and evaluation included)."""
    out.mkdir(parents=True)
    job = next(_jobs)
    argv = ["--method", method, "--out", str(out), "--seeds", ",".join(map(str, args.seed_list)),
            "--target", str(args.target), "--eval-every", str(args.eval_every),
            "--max-train-s", str(args.max_train_s), "--rows", str(args.rows),
            "--width", str(args.width)]  # fmt: skip
    if cluster:
        argv += ["--cluster", cluster]
    before = {h: hosts.tx_bytes(h) for h in "ab"}
    agents = [hosts.torchrun(h, str(WORKER), argv, log=out / f"{h}.log", nproc=1,
                             port=29400 + job % 500, run_id=f"tta{job}") for h in "ab"]  # fmt: skip
    start = time.monotonic()
    deadline = start + JOB_S
    while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
        time.sleep(0.5)
    sent = {h: hosts.tx_bytes(h) - before[h] for h in "ab"}
    codes = [a.poll() for a in agents]
    if codes != [0, 0]:
        for host in "ab":
            hosts.kill(host)
        tail = "\n".join(f"--- {h}.log\n" + (out / f"{h}.log").read_text()[-2500:] for h in "ab")
        print(f"{method}: the job failed (exit codes {codes}); logs in {out}\n{tail}")
    records: dict[int, dict[int, dict]] = {}
    for path in sorted(out.glob("seed*-rank*.json")):
        record = json.loads(path.read_text())
        records.setdefault(record["seed"], {})[record["rank"]] = record
    return {
        "method": method,
        "cluster": cluster,
        "exit_codes": codes,
        "job_bytes": sent,
        "wall_s": time.monotonic() - start,
        "seeds": {seed: merge(ranks) for seed, ranks in records.items() if len(ranks) == 2},
    }


def merge(ranks: dict[int, dict]) -> dict:
    """One seed's run from both ranks' records: rank 0's clocks, plan and evaluations, and the
    link bytes of both hosts."""
    run = dict(ranks[0])
    run["train_bytes"] = sum(r["train_bytes"] for r in ranks.values())
    run["eval_bytes"] = sum(r["eval_bytes"] for r in ranks.values())
    run["step_measured"] = statistics.median(run["step_s"][2:] or run["step_s"])
    return run


def summarize(job: dict) -> dict:
    """Medians over the seeds that reached the target (None where a seed did not)."""
    runs = list(job["seeds"].values())
    reached = [r for r in runs if r["reached"]]
    every = len(reached) == len(runs) and runs

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    plan = runs[0].get("plan") if runs else None
    probe = [r["probe"] for r in runs if r.get("probe")]
    return {
        "method": job["method"], "seeds": len(runs), "reached": len(reached),
        "train_s": median([r["reached"]["train_s"] for r in reached]) if every else None,
        "with_eval_s": median([r["reached"]["train_s"] + r["reached"]["eval_s"]
                               for r in reached]) if every else None,
        "samples": median([r["reached"]["samples"] for r in reached]) if every else None,
        "samples_per_s": median([r["steps"] * r["task"]["rows"] / r["train_s"] for r in runs]),
        "train_bytes": median([r["train_bytes"] for r in runs]),
        "eval_bytes": median([r["eval_bytes"] for r in runs]),
        "step_measured": median([r["step_measured"] for r in runs]),
        "step_predicted": plan["step_time"] if plan else None,
        "plan": plan,
        "allreduce_s": median([p["allreduce_s"] for p in probe]),
        "compute_s": median([p["compute_s"] for p in probe]),
        "gradient_bytes": probe[0]["gradient_bytes"] if probe else None,
    }  # fmt: skip


def plan_text(plan: dict | None) -> str:
    """`2 stages [7|6 nodes] 1f1b x4` or `data parallel x2 1f1b x4`."""
    if plan is None:
        return "torch DDP"
    stages, how = plan["stages"], f"{plan['schedule']} M={plan['num_microbatches']}"
    if len(stages) == 1:
        return f"data parallel x{len(stages[0]['ranks'])} {how}"
    nodes = "|".join(str(s["num_nodes"]) for s in stages)
    return f"{len(stages)} stages [{nodes} nodes] {how}"


def is_pipeline(plan: dict | None) -> bool | None:
    return None if plan is None else len(plan["stages"]) > 1


def link_rate(rate: str, rows: dict[str, dict]) -> float | None:
    """Bytes/s of the link: the shaped rate, or for the unshaped link what DDP's all-reduce
    probe moved each way (its gradients' bytes over its time)."""
    shaped = parse_rate(rate)
    if shaped is not None:
        return shaped
    ddp = rows.get("ddp")
    if ddp and ddp["allreduce_s"]:
        return ddp["gradient_bytes"] / ddp["allreduce_s"]
    return None


def crossing(points: list[tuple[float, float]]) -> float | None:
    """The link rate where log(time / DDP's time) crosses zero, interpolated in log rate
    between the first adjacent pair of rates (sorted) on either side; None without one."""
    points = sorted(p for p in points if p[0] and p[1])
    for (r0, q0), (r1, q1) in zip(points, points[1:], strict=False):
        l0, l1 = math.log(q0), math.log(q1)
        if (l0 > 0) != (l1 > 0):
            return math.exp(math.log(r0) + (math.log(r1) - math.log(r0)) * l0 / (l0 - l1))
    return None


def measured_crossovers(results: dict) -> dict[str, float | None]:
    """Per method, the link rate where its time to the target crosses DDP's."""
    out = {}
    for method in results["methods"]:
        if method == "ddp":
            continue
        points = []
        for rate, rows in results["rates"].items():
            ddp, mine = rows.get("ddp"), rows.get(method)
            if ddp and mine and ddp["train_s"] and mine["train_s"]:
                points.append((link_rate(rate, rows), mine["train_s"] / ddp["train_s"]))
        out[method] = crossing(points)
    return out


def planner_switches(results: dict, method: str = "auto") -> list[str]:
    """The sweep's adjacent rates between which `method`'s plan changes kind."""
    kinds = []
    for rate, rows in results["rates"].items():
        if rows.get(method) and rows[method]["plan"]:
            kinds.append((link_rate(rate, rows), rate, is_pipeline(rows[method]["plan"])))
    kinds.sort(key=lambda k: k[0] or math.inf)
    return [f"between {a[1]} ({'pipeline' if a[2] else 'data parallel'}) and {b[1]} "
            f"({'pipeline' if b[2] else 'data parallel'})"
            for a, b in zip(kinds, kinds[1:], strict=False) if a[2] != b[2]]  # fmt: skip


def planner_crossover(cluster: dict, width: int, rows: int, lo: float = 1e7,
                      hi: float = 1e11) -> dict:  # fmt: skip
    """The outer level's bandwidth where `plan(schedule="auto", global_batch_size=)` switches
    between a pipeline and data parallelism, on `cluster` (the last `auto` run's) with that
    bandwidth changed, and costs profiled here on one pinned core (compile profiles on rank 0
    in the run: its costs may differ). Bisection in log bandwidth; None when the kind is the
    same at both ends."""
    import torch
    from tta_worker import Task, digits

    import pdcompile
    from pdcompile import Cluster

    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    task = Task(width=width, rows=rows)
    x, y, *_ = digits()
    model = task.model(0)
    gm = pdcompile.trace(model, (x[: task.rows],))
    costs = pdcompile.analyze(gm, (x[: task.rows],), loss_fn=torch.nn.functional.cross_entropy,
                              targets=y[: task.rows], optimizer=task.optimizer)  # fmt: skip

    def pipelined(bandwidth: float) -> bool:
        data = json.loads(json.dumps(cluster))
        data["levels"][-1][1] = bandwidth
        plan = pdcompile.plan(costs, Cluster.from_dict(data), schedule="auto",
                              global_batch_size=task.rows)  # fmt: skip
        return len(plan.stages) > 1

    low, high = pipelined(lo), pipelined(hi)
    if low == high:
        return {"rate": None, "below": low, "above": high}
    for _ in range(20):  # 2^-20 of four decades: well under 1%
        mid = math.sqrt(lo * hi)
        if pipelined(mid) == low:
            lo = mid
        else:
            hi = mid
    return {"rate": math.sqrt(lo * hi), "below": low, "above": high}


def gbit(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 8 / 1e9:.3g} Gbit/s"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s" if value >= 1 else f"{value * 1e3:.0f} ms"


def megabytes(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f} MB"


def table(results: dict) -> Table:
    """One row per rate and method."""
    title = (f"time to {results['target']:.0%} validation accuracy, medians over "
             f"{len(results['seeds'])} seed(s): {results['task_text']}")  # fmt: skip
    out = Table(title=title)
    for column in ("link", "method", "plan", "reached", "train s", "with eval", "samples",
                   "samples/s", "link bytes", "vs DDP bytes", "step pred.", "step meas.",
                   "allreduce/compute"):  # fmt: skip
        out.add_column(column, justify="right")
    for rate, rows in results["rates"].items():
        ddp = rows.get("ddp")
        for method, row in rows.items():
            fewer = "-"
            if ddp and ddp["train_bytes"] and method != "ddp":
                fewer = f"{1 - row['train_bytes'] / ddp['train_bytes']:.1%} fewer"
            ratio = (f"{row['allreduce_s'] / row['compute_s']:.1f}x" if row["allreduce_s"]
                     else "")  # fmt: skip
            out.add_row(
                rate, method, plan_text(row["plan"]), f"{row['reached']}/{row['seeds']}",
                seconds(row["train_s"]), seconds(row["with_eval_s"]),
                "-" if row["samples"] is None else f"{row['samples']:.0f}",
                f"{row['samples_per_s']:.0f}" if row["samples_per_s"] else "-",
                megabytes(row["train_bytes"]), fewer, seconds(row["step_predicted"]),
                seconds(row["step_measured"]), ratio,
            )  # fmt: skip
        out.add_section()
    return out


def crossover_lines(results: dict) -> list[str]:
    lines = []
    for rate, rows in results["rates"].items():
        auto, ddp = rows.get("auto"), rows.get("ddp")
        if auto:
            kind = {True: "a pipeline", False: "data parallelism", None: "-"}
            speedup = (f"; DDP's time / auto's: {ddp['train_s'] / auto['train_s']:.2f}x"
                       if ddp and ddp["train_s"] and auto["train_s"] else "")  # fmt: skip
            cluster = auto["plan"]["cluster"] if auto["plan"] else "-"
            planned = kind[is_pipeline(auto["plan"])]
            lines.append(f"{rate} ({gbit(link_rate(rate, rows))}): auto planned {planned} on "
                         f"cluster {cluster}{speedup}")  # fmt: skip
    switches = planner_switches(results)
    lines.append("planner switches (sweep): " + ("; ".join(switches) or "nowhere in the sweep"))
    bisect = results.get("planner_crossover")
    if bisect:
        lines.append(
            f"planner switches (bisection on the outer bandwidth): {gbit(bisect['rate'])}"
            f" (pipeline below: {bisect['below']}, above: {bisect['above']})"
        )
    for method, rate in results["measured_crossover"].items():
        lines.append(f"measured: {method}'s time to the target crosses DDP's at {gbit(rate)}")
    return lines


def plot(results: dict, path: Path) -> None:
    """Time to the target (training, evaluation excluded) against link rate, log x, one line
    per method; the unshaped link at its measured rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for method in results["methods"]:
        points = sorted((link_rate(rate, rows) * 8 / 1e9, rows[method]["train_s"])
                        for rate, rows in results["rates"].items()
                        if rows.get(method) and rows[method]["train_s"]
                        and link_rate(rate, rows))  # fmt: skip
        if points:
            axes.plot(*zip(*points, strict=True), marker="o", label=method)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("link rate, Gbit/s (unshaped: DDP's measured all-reduce rate)")
    axes.set_ylabel(f"seconds to {results['target']:.0%} (training)")
    axes.set_title("time to accuracy, two hosts of one core each")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", help=f"comma-separated (default {RATES})")
    parser.add_argument("--seeds", type=int, help="seeds per method and rate (default 3)")
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_RATES}, one seed")
    parser.add_argument("--cluster", help='for every compile method but auto, e.g. "2@{rate}"')
    parser.add_argument("--unshaped-as", default="10Gbit/s",
                        help="{rate} in --cluster on the unshaped link")  # fmt: skip
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-train-s", type=float, default=240.0)
    parser.add_argument("--rows", type=int, default=32, help="rows per step (global batch)")
    parser.add_argument("--width", type=int, default=2048, help="the MLP's hidden width")
    parser.add_argument(
        "--shared-cache",
        action="store_true",
        help="keep pdcompile's default cache (else a fresh one per rate)",
    )
    parser.add_argument("--no-bisect", action="store_true")
    parser.add_argument("--merge", nargs="+", metavar="RESULTS",
                        help="join earlier runs' results.json files; run nothing")  # fmt: skip
    parser.add_argument("--out", default=str(HERE.parent / "out" / "time_to_accuracy"))
    args = parser.parse_args()
    args.rates = args.rates or (QUICK_RATES if args.quick else RATES)
    args.seed_list = list(range(args.seeds or (1 if args.quick else 3)))
    methods = args.methods.split(",")
    if args.cluster and "auto+cluster" not in methods:
        methods.append("auto+cluster")
    args.method_list = methods
    return args


def merged(paths: list[str]) -> dict:
    """Earlier runs' results joined: their rates slowest link first (the unshaped last), the
    methods in the order first seen, the planner's crossover of the last run that has one."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    results = {**runs[-1], "rates": {}, "jobs": {}, "merged": paths,
               "load_before": [r["load_before"] for r in runs],
               "load_after": [r.get("load_after") for r in runs]}  # fmt: skip
    results["methods"] = list(dict.fromkeys(m for r in runs for m in r["methods"]))
    for run in runs:
        results["rates"].update(run["rates"])
        results["jobs"].update(run["jobs"])
        if run.get("planner_crossover"):
            results["planner_crossover"] = run["planner_crossover"]
    order = sorted(results["rates"], key=lambda r: parse_rate(r) or math.inf)
    results["rates"] = {r: results["rates"][r] for r in order}
    results["measured_crossover"] = measured_crossovers(results)
    return results


def main() -> None:
    args = arguments()
    if args.merge:
        report(merged(args.merge), Path(args.out) / time.strftime("merged-%Y%m%d-%H%M%S"))
        return
    if reason := unavailable():
        raise SystemExit(f"cannot make two hosts here: {reason}")
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    results = {"target": args.target, "seeds": args.seed_list, "methods": args.method_list,
               "cluster_template": args.cluster, "rates": {}, "jobs": {},
               "task_text": f"MLP 64-{args.width}x4-10 on digits, {args.rows} rows per step",
               "load_before": os.getloadavg()}  # fmt: skip
    for rate in args.rates.split(","):
        rate = rate.strip()
        if not args.shared_cache:  # the cluster measured at this rate, not one cached before
            os.environ["PDCOMPILE_CACHE_DIR"] = str(out / rate.replace("/", "_") / "cache")
        with TwoHosts() as hosts:
            if parse_rate(rate) is not None:
                hosts.shape(parse_rate(rate))
            for method in args.method_list:
                cluster = cluster_for(args.cluster if method != "auto" else None, rate,
                                      args.unshaped_as)  # fmt: skip
                job = run_job(hosts, method, args, cluster, out / rate.replace("/", "_") / method)
                results["jobs"].setdefault(rate, {})[method] = job
                if job["seeds"]:
                    results["rates"].setdefault(rate, {})[method] = summarize(job)
                print(f"{rate} {method}: {json.dumps(results['rates'].get(rate, {}).get(method))}",
                      flush=True)  # fmt: skip
    results["load_after"] = os.getloadavg()
    results["measured_crossover"] = measured_crossovers(results)
    autos = [rows["auto"]["plan"] for rows in results["rates"].values()
             if rows.get("auto") and rows["auto"]["plan"]]  # fmt: skip
    if autos and not args.no_bisect:
        results["planner_crossover"] = planner_crossover(autos[-1]["cluster_dict"], args.width,
                                                         args.rows)  # fmt: skip
    report(results, out)


def report(results: dict, out: Path) -> None:
    """The table and the crossover lines on the console and in `table.txt`, the JSON, the PNG."""
    console = Console(width=220, record=True)
    console.print(table(results))
    for line in crossover_lines(results):
        console.print(line)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.txt").write_text(console.export_text())
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    plot(results, out / "time_to_accuracy.png")
    print(f"wrote {out}/table.txt, results.json, time_to_accuracy.png")


if __name__ == "__main__":
    main()
