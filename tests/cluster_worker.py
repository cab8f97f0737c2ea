"""The torchrun worker that measures the job's cluster (tests/test_multihost.py starts it).

    torchrun --nnodes 2 --nproc-per-node 2 ... tests/cluster_worker.py --out DIR

Every rank measures the cluster (`runtime.cluster_measure.measure_cluster`, no cache) and
writes it as `cluster-rank<r>.json` in DIR.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from pdcompile.runtime.cluster_measure import measure_cluster
from pdcompile.runtime.distributed import init_process_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = init_process_group(rank, world_size, timeout_s=120)
    cluster = measure_cluster(rank, world_size, device, cache=False, timeout_s=120)
    (out / f"cluster-rank{rank}.json").write_text(cluster.to_json())


if __name__ == "__main__":
    main()
