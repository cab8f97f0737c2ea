"""Time `coarsen` on a 2,000-node graph shaped like a transformer (blocks with skip edges).

python benchmarks/coarsening.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from pdcompile import CostGraph
from pdcompile.passes.coarsening import coarsen


def transformer_like(blocks: int = 40, per_block: int = 50) -> CostGraph:
    g = CostGraph(batch_size=8)
    previous = None
    for b in range(blocks):
        for i in range(per_block):
            name = f"b{b}n{i}"
            scope = f"layers.{b}.{'attn' if i < per_block // 2 else 'mlp'}"
            g.add_node(name, forward_s=1e-4 * (1 + i % 7), backward_s=2e-4, scope=scope,
                       param_bytes=1000 * (i % 3), output_bytes=100)  # fmt: skip
            if previous:
                g.add_edge(previous, name, 100)
            if i == per_block - 1:  # residual from the block's first node
                g.add_edge(f"b{b}n0", name, 100)
            previous = name
    return g


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    g = transformer_like()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        layers = coarsen(g, 64)
        times.append(time.perf_counter() - start)
    kept = all(math.isclose(layers.totals()[k], v, rel_tol=1e-12) for k, v in g.totals().items())
    median = statistics.median(times)
    print(f"{len(g.nodes)} nodes -> {len(layers.nodes)} layers: median {median:.4f} s over "
          f"{args.repeats} runs; totals kept: {kept}")  # fmt: skip


if __name__ == "__main__":
    main()
