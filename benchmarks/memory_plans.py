"""The planner under memory limits: the GPT-style decoder at 3 limits, against its plan without one.

    python benchmarks/memory_plans.py [--steps 6] [--profile] [--json out.json]

`pdcompile.zoo.GPT` (4 layers, 64 wide, tied embedding, dropout off; SGD with momentum), one
microbatch of 8 x 32 tokens, priced analytically (`profile=False`: the plans do not depend on
this machine's load; `--profile` measures the node times instead, one thread), planned with
`schedule="auto"` on 2 devices with 4 microbatches: the planner chooses schedule, partition,
replicas and recomputation per stage. The limits:

- none;
- the smallest any plan without recomputation fits in (bisected with `recompute=False`);
- halfway between it and the least any plan needs (named by the `PartitionError` of a limit
  no plan fits);
- 2% above that least.

Each plan then trains on 2 spawned gloo ranks (one thread each) with the memory probe: the
table gives per rank the predicted peak (`Plan.rank_memory`; "held": without what a
recomputing backward holds inside it, which the probe's parts do not see on the CPU) and the
measured one, and the median time per step (after 2 warm-up steps) against the predicted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile import PartitionError, Plan, PlanWarning
from pdcompile.compiling.pipelined_module import PipelinedModule
from pdcompile.core.text import human_bytes
from pdcompile.passes.planning.recompute_choice import KEY
from pdcompile.runtime import memory_probe
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline

M, CLUSTER = 4, "2"


def model_case() -> tuple:
    torch.manual_seed(0)
    config = pdcompile.zoo.GPTConfig(dropout=0.0, n_layer=4)
    model = pdcompile.zoo.GPT(config).train()
    x = torch.randint(0, config.vocab_size, (8, 32))
    y = torch.randint(0, config.vocab_size, (8, 32))
    return model, x, y


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def costs(profile: bool = False) -> tuple:
    model, x, y = model_case()
    gm = pdcompile.trace(model, (x,))
    return gm, pdcompile.analyze(gm, (x,), profile=profile, optimizer=optimizer, loss_fn=loss_fn,
                                 targets=y, cache=False, progress=False)  # fmt: skip


def planned(graph, memory: float | None, **options) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        return pdcompile.plan(graph, CLUSTER, schedule="auto", num_microbatches=M,
                              memory=memory, **options)  # fmt: skip


def limits(graph) -> list[tuple[str, float | None]]:
    """(name, bytes) of the limits the module lists."""
    free = planned(graph, None)
    low, high = 0.0, float(max(free.rank_memory))
    while high - low > high * 1e-3:  # the smallest a plan without recomputation fits in
        middle = (low + high) / 2
        try:
            fits = planned(graph, middle, recompute=False).fits_memory
        except PartitionError:
            fits = False
        low, high = (low, middle) if fits else (middle, high)
    try:
        planned(graph, high / 4)
        raise AssertionError("a quarter of the limit still fits: raise the model's size")
    except PartitionError as exc:
        # every schedule's least ("auto" lists each): the smallest of them
        least = min(float(x) for x in re.findall(r"\((\d+) B\), on rank", str(exc)))
    return [("none", None), ("smallest without recomputation", high),
            ("halfway", (high + least) / 2), ("least + 2%", 1.02 * least)]  # fmt: skip


def _rank(rank: int, world_size: int, init_file: str, plans: list[str], steps: int,
          out: str) -> None:  # fmt: skip
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=300)
    torch.set_num_threads(1)
    model, x, y = model_case()
    gm = pdcompile.trace(model, (x,))
    inputs, targets = torch.cat([x] * M), torch.cat([y] * M)
    results = []
    for text in plans:
        plan = Plan.from_json(text)
        pipeline = DistributedPipeline(
            pdcompile.codegen(gm, plan), rank=rank, schedule=plan.schedule, num_microbatches=M,
            loss_fn=loss_fn, optimizer=optimizer, device=device, timeout_s=300,
        )  # fmt: skip
        module = PipelinedModule(pipeline, rank=rank)
        module.measure_memory()
        seconds = []
        for step in range(2 + steps):
            dist.barrier()
            start = time.perf_counter()
            module.train_step(inputs, targets)
            if step >= 2:
                seconds.append(time.perf_counter() - start)
        measured = module.measured_memory[rank]
        compared = memory_probe.compare(module.plan, {rank: measured})[rank]
        results.append({
            "total": measured.peak.total, "messages": measured.messages,
            "held": compared.comparable, "step_s": statistics.median(seconds),
        })  # fmt: skip
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def rows(steps: int, profile: bool) -> list[dict]:
    torch.set_num_threads(1)  # profiled as the ranks run
    _, graph = costs(profile)
    chosen = [(name, limit, planned(graph, limit)) for name, limit in limits(graph)]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), [p.to_json() for *_, p in chosen],
                              steps, tmp), nprocs=2, join=True)  # fmt: skip
        runs = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(2)]
    out = []
    for i, (name, limit, plan) in enumerate(chosen):
        info = plan.options.get(KEY) or {}
        out.append({
            "limit": name, "limit_bytes": limit, "schedule": plan.schedule,
            "stages": [{"nodes": len(s.nodes), "replicas": s.replicas, "ranks": list(s.ranks),
                        "recompute": s.recompute if isinstance(s.recompute, bool)
                        else len(s.recompute), "predicted_bytes": s.memory_bytes}
                       for s in plan.stages],
            "predicted_rank_bytes": list(plan.rank_memory),
            "held_rank_bytes": [runs[r][i]["held"] for r in range(2)],
            "measured_rank_bytes": [runs[r][i]["total"] for r in range(2)],
            "message_bytes": [runs[r][i]["messages"] for r in range(2)],
            "predicted_step_s": plan.step_time,
            "measured_step_s": max(runs[r][i]["step_s"] for r in range(2)),
            "predicted_slowdown": info.get("slowdown", 0.0),
        })  # fmt: skip
    return out


def _stages(row: dict) -> str:
    def one(s: dict) -> str:
        how = {True: ", whole", False: ""}.get(s["recompute"], f", {s['recompute']} bounds")
        return f"{s['nodes']}n x{s['replicas']}{how}"

    return "; ".join(one(s) for s in row["stages"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--profile", action="store_true", help="profile the node times")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = rows(args.steps, args.profile)
    table = Table(title="GPT-style decoder on 2 gloo ranks: the plan at each memory limit "
                  "(bytes per rank: predicted peak / held / measured)")  # fmt: skip
    for column in ("limit", "schedule", "stages (nodes x replicas, recomputation)",
                   "rank 0", "rank 1", "step predicted", "step measured", "slowdown"):  # fmt: skip
        table.add_column(column)
    for r in results:
        ranks = [f"{human_bytes(p)} / {human_bytes(h)} / {human_bytes(m)}" for p, h, m in zip(
            r["predicted_rank_bytes"], r["held_rank_bytes"], r["measured_rank_bytes"],
            strict=True)]  # fmt: skip
        limit = r["limit"] + ("" if r["limit_bytes"] is None else
                              f" ({human_bytes(r['limit_bytes'])})")  # fmt: skip
        table.add_row(limit, r["schedule"], _stages(r), *ranks,
                      f"{r['predicted_step_s'] * 1e3:.2f} ms",
                      f"{r['measured_step_s'] * 1e3:.2f} ms",
                      f"{r['predicted_slowdown']:+.1%}")  # fmt: skip
    Console(width=200).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
