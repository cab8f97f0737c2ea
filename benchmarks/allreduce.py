"""All-reduce benchmark: gloo's `all_reduce` against the runtime's (`DistributedComm.all_reduce`,
which exchanges whole tensors in groups of up to 4 ranks on gloo).

    python benchmarks/allreduce.py [--repeats 60]

Two gloo ranks with one thread each sum a tensor of 8 B, 64 KiB (the GPT's tied embedding
gradient) and 256 KiB, both arriving together (after a barrier) and with rank 0 arriving 2 ms
late, as a stage finishing its backward after its peer. Prints the median seconds of the rank
arriving last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from pdcompile.runtime.distributed import DistributedComm, init_process_group

SIZES = {"8 B": 2, "64 KiB": 16 * 1024, "256 KiB": 64 * 1024}  # float32 values


def _rank(rank: int, init_file: str, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    device = init_process_group(rank, 2, init_file=init_file, timeout_s=60)
    comm = DistributedComm(rank, [(0, 1)], timeout_s=60, device=device)
    gloo = dist.new_group([0, 1])
    rows = []
    for name, n in SIZES.items():
        tensor = torch.ones(n)
        runtimes = {
            "gloo all_reduce": lambda t=tensor: dist.all_reduce(t, group=gloo),
            "DistributedComm": lambda t=tensor: comm.all_reduce([t], (0, 1), "bench"),
        }
        for runtime, call in runtimes.items():
            for late in (0.0, 0.002):
                seconds = []
                for _ in range(repeats + 5):
                    dist.barrier(group=gloo)
                    if rank == 0 and late:
                        time.sleep(late)
                    start = time.perf_counter()
                    call()
                    seconds.append(time.perf_counter() - start)
                rows.append((name, runtime, late, statistics.median(seconds[5:])))
    if rank == 0:  # rank 0 arrives last (or together)
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), args.repeats, out), nprocs=2)
        with open(out) as f:
            rows = json.load(f)
    table = Table(title="all-reduce over 2 gloo ranks, 1 thread each (median, rank arriving last)")
    for column in ("size", "implementation", "together", "one 2 ms late"):
        table.add_column(column, justify="right")
    for name in SIZES:
        for runtime in ("gloo all_reduce", "DistributedComm"):
            cells = [f"{s * 1e6:.0f} us" for n, r, _, s in rows if n == name and r == runtime]
            table.add_row(name, runtime, *cells)
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
