"""`schedule="auto"` against every schedule picked by hand, on captured models.

    python benchmarks/schedule_auto.py [--json out.json]

The GPT-style decoder (`pdcompile.zoo.GPT`, tied embeddings) and a heavy-head model (a small
trunk under a wide vocabulary projection) are captured and priced analytically (`profile=False`,
so the table does not depend on this machine's load), then planned on 3 clusters x 2 memory
limits (none, and 1.05 x the peak rank memory of the 1F1B plan, which rules out the schedules
holding more activations). Every message costs its rank 100 us (`RuntimeCosts(message_s=1e-4)`),
so the microbatch count is a trade-off. The batch is what `plan()` runs by default, 2p
microbatches of the graph's rows (G rows); `schedule="auto"` with `global_batch_size=G`
searches schedule, chunks, microbatch count, partition and replicas together. For each setting
the table gives its choice and, as ratios to its step time, auto without the count search (each
schedule at the default count) and every single-schedule plan as `plan(..., schedule=name,
num_microbatches=2p)` makes it (`-` where the plan does not fit or the schedule cannot run).
Auto is the minimum over them by construction (`tests/test_schedule_auto.py`,
`tests/test_microbatch_search.py` check it); the table shows by how much each loses.
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
import torch.nn as nn
from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile import Cluster, CostGraph, PartitionError, PlanWarning
from pdcompile.core.cluster import RuntimeCosts
from pdcompile.passes.planning.schedule_choice import candidates

CLUSTERS = ("4@10GB/s", "8@10GB/s", "2@10GB/s,2@100MB/s")
RUNTIME = RuntimeCosts(message_s=1e-4)


class HeavyHead(nn.Module):
    """A 4-layer MLP trunk under a projection onto 8192 classes (most of the compute)."""

    def __init__(self, width: int = 256, classes: int = 8192) -> None:
        super().__init__()
        layers = [nn.Linear(64, width), nn.GELU()]
        for _ in range(3):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.trunk = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def models() -> dict[str, CostGraph]:
    torch.manual_seed(0)
    config = pdcompile.zoo.GPTConfig(dropout=0.0, n_layer=8)
    gpt = pdcompile.zoo.GPT(config).train()
    tokens = torch.randint(0, config.vocab_size, (8, 32))
    heavy, x = HeavyHead().train(), torch.randn(32, 64)
    out = {}
    for name, model, example in (("gpt", gpt, tokens), ("heavy-head", heavy, x)):
        gm = pdcompile.trace(model, (example,))
        out[name] = pdcompile.analyze(gm, (example,), profile=False, progress=False)
    return out


def _quiet_plan(costs: CostGraph, cluster: Cluster, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        return pdcompile.plan(costs, cluster, **kwargs)


def _replicas(row: dict) -> str:
    """A layout: replicas per stage, e.g. [2, 2]."""
    return "[" + ", ".join(map(str, row["replicas"])) + "]"


def rows() -> list[dict]:
    results = []
    for model, costs in models().items():
        for text in CLUSTERS:
            free = Cluster.parse(text, runtime=RUNTIME)
            peak = max(_quiet_plan(costs, free).rank_memory)
            batch = 2 * free.num_devices * costs.batch_size
            for limit in (None, 1.05 * peak):
                cluster = Cluster.parse(text, memory=limit, runtime=RUNTIME)
                auto = _quiet_plan(costs, cluster, schedule="auto", global_batch_size=batch)
                default = batch // costs.batch_size  # every single plan at the same batch
                fixed = _quiet_plan(costs, cluster, schedule="auto", num_microbatches=default)
                ratios = {"auto, M fixed": fixed.step_time / auto.step_time}
                for name, v in candidates():
                    try:
                        single = _quiet_plan(costs, cluster, schedule=name, chunks=v,
                                             num_microbatches=default)  # fmt: skip
                    except PartitionError:
                        ratios[f"{name}/{v}"] = None
                        continue
                    fits = single.fits_memory
                    ratios[f"{name}/{v}"] = single.step_time / auto.step_time if fits else None
                results.append({
                    "model": model, "cluster": text,
                    "memory": "none" if limit is None else f"{limit / 2**20:.1f} MiB",
                    "chosen": next(f"{r['schedule']}/{r['chunks']} x{_replicas(r)}, M "
                                   f"{r['num_microbatches']}"
                                   for r in auto.options["auto"] if r["chosen"]),
                    "batch": batch,
                    "step_time_s": auto.step_time, "ratios": ratios,
                })  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = rows()
    names = list(results[0]["ratios"])
    table = Table(title="schedule='auto' vs each schedule (step time / auto's; - : does not fit)")
    for column in ("model", "cluster", "memory", "G", "auto chose", "step"):
        table.add_column(column)
    for name in names:
        table.add_column(name, justify="right")
    for r in results:
        cells = [f"{x:.3f}" if x is not None else "-" for x in r["ratios"].values()]
        step = f"{r['step_time_s'] * 1e3:.3f} ms"
        table.add_row(r["model"], r["cluster"], r["memory"], str(r["batch"]), r["chosen"], step,
                      *cells)  # fmt: skip
    Console(width=200).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
