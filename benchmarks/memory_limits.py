"""dp (safe memory bound) against cpsat (exact memory) under a tight memory limit.

For each published profile on 8 devices at 3.125 GB/s (schedule 1f1b), the limit is 70% of the
largest stage memory of dp's unconstrained plan. The solvers' own plans are compared, without
recomputation (`recompute=False`: the planner would otherwise recompute to fit).

    python benchmarks/memory_limits.py
"""

from __future__ import annotations

from pathlib import Path

import pdcompile
from pdcompile import Cluster, CostGraph

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "pipedream"


def main() -> None:
    for model in ("vgg16", "resnet50", "gnmt"):
        g = CostGraph.from_pipedream(DATA / model / "graph.txt", batch_size=128)
        free = pdcompile.plan(g, Cluster.parse("8@3.125GB/s"), schedule="1f1b")
        limit = 0.7 * max(s.memory_bytes for s in free.stages)
        cluster = Cluster.parse("8@3.125GB/s", memory=limit)
        results = {}
        for solver in ("dp", "cpsat"):
            try:
                plan = pdcompile.plan(g, cluster, solver=solver, schedule="1f1b", recompute=False)
                results[solver] = f"{plan.predicted_time * 1e3:.1f} ms (fits: {plan.fits_memory})"
            except pdcompile.PartitionError:
                results[solver] = "no plan"
        print(
            f"{model:9s} limit {limit / 1e9:.2f} GB  dp {results['dp']}  cpsat {results['cpsat']}"
        )


if __name__ == "__main__":
    main()
