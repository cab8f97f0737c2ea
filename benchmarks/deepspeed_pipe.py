"""DeepSpeed's pipeline engine on the runtime benchmark's models and split: one round.

    DS_ACCELERATOR=cpu DSVENV/bin/python benchmarks/deepspeed_pipe.py --model mlp --steps 10
        --out FILE

`benchmarks/runtime.py --deepspeed DSVENV/bin/python` runs it between its own rounds. DeepSpeed
lives in a venv of its own (its CUDA-free build beside this CPU torch):

    python -m venv DSVENV
    DS_BUILD_OPS=0 DSVENV/bin/pip install "torch==2.13.0" deepspeed
    DSVENV/bin/pip install -e .

Two spawned ranks (gloo: `DS_ACCELERATOR=cpu`), one thread each. Each rank's DeepSpeed stage is
one layer: pdcompile's stage module of that rank, from the same `two_stage_program` as
`runtime.py` (same model, seed, data and split; torch's pipelining runs the same modules there),
behind the same positional adapters. `train_batch` runs the 8 microbatches with DeepSpeed's
`TrainSchedule` and SGD(lr=0.01). Like torch's pipelining in `runtime.py`, a tied tensor's copies
on the two stages are not summed (the GPT's embedding): pdcompile's all-reduce of it is work the
peers skip. Writes each rank's wall and CPU seconds per step and the step losses to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from cases import CASES

from runtime import MICROBATCHES, _First, _Last, two_stage_program


class _Spread(nn.Module):
    """DeepSpeed hands a stage the tuple it received as one argument: spread it."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, values: tuple[torch.Tensor, ...] | torch.Tensor) -> torch.Tensor:
        return self.stage(*values) if isinstance(values, tuple) else self.stage(values)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    model, x, y, loss_fn = CASES[args.model]()
    program = two_stage_program(model, x)
    names = [c.name for c in program.channels]
    layers = [_First(program.stages[0], names), _Spread(_Last(program.stages[1], names))]
    net = PipelineModule(layers=layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    rows = x.shape[0] // MICROBATCHES
    config = {
        "train_batch_size": x.shape[0], "train_micro_batch_size_per_gpu": rows,
        "gradient_accumulation_steps": MICROBATCHES, "steps_per_print": 10**9,
    }  # fmt: skip
    optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.01)
    engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    batches = [(x[k * rows : (k + 1) * rows], y[k * rows : (k + 1) * rows])
               for k in range(MICROBATCHES)]  # fmt: skip

    def step() -> float:
        return float(engine.train_batch(data_iter=iter(batches)))

    step()  # warm up
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    losses = [step() for _ in range(args.steps)]
    dist.barrier()
    mine = {"wall": (time.perf_counter() - wall) / args.steps,
            "cpu": (time.process_time() - cpu) / args.steps, "losses": losses}  # fmt: skip
    gathered = [None, None]
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(CASES), required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mp.spawn(_rank, args=(args, _port()), nprocs=2, join=True)


if __name__ == "__main__":
    main()
