"""The torchrun worker of benchmarks/time_to_accuracy.py: one method, every seed, one rank.

    torchrun --nnodes 2 --nproc-per-node 1 ... benchmarks/tta_worker.py --method auto --out DIR
        [--seeds 0,1,2] [--cluster SPEC] [--target 0.95] [--eval-every 10]
        [--max-train-s 240] [--max-steps 3000] [--rows 32] [--width 2048]

Pins itself to core RANK (before torch starts any thread), runs one thread, and for each seed
trains the task (`Task`: an MLP of 2048-wide layers on scikit-learn's digits, 32 rows per
step) from the seed's initial weights on the seed's batches until the validation accuracy
reaches `--target` (checked every `--eval-every` steps) or the training time passes
`--max-train-s`. Methods:
- `ddp`: torch's DistributedDataParallel (gloo, default buckets, overlap on), each rank half
  of every batch;
- `auto`: `pdcompile.compile` as a user calls it: no `cluster=`, `schedule="auto"`,
  `global_batch_size=`;
- `auto+cluster`: the same with `cluster=--cluster`;
- `1f1b`, `pipedream`: `compile(schedule=..., num_microbatches=4)`, `cluster=--cluster` when
  given.
Each rank writes `seed<k>-rank<r>.json` per seed: the training and evaluation seconds, the
bytes its host sent over the link in each (its veth's tx counter, read from sysfs: `ip netns
exec` mounts the namespace's own), every evaluation, and on rank 0 the plan that ran; `ddp`
also a probe of its compute and all-reduce times (taken after the run, off the counters).
"""

from __future__ import annotations

import os

# pinned before torch starts: every thread made after this inherits the core
os.sched_setaffinity(0, {int(os.environ.get("RANK", 0)) % os.cpu_count()})

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

METHODS = ("ddp", "auto", "auto+cluster", "1f1b", "pipedream")
NAMED_MICROBATCHES = 4  # microbatches per step of `1f1b` and `pipedream`


@dataclass(frozen=True)
class Task:
    """The MLP 64 -> `width` x `layers` -> 10 on digits, `rows` per step, SGD with momentum."""

    width: int = 2048
    layers: int = 4  # hidden layers: layers - 1 of them `width` x `width`
    rows: int = 32
    lr: float = 0.02
    momentum: float = 0.9

    def model(self, seed: int) -> nn.Sequential:
        """The seed's initial weights, the same in every method."""
        torch.manual_seed(seed)
        widths = (64, *[self.width] * self.layers, 10)
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:], strict=False):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1]).train()

    def optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)


def digits() -> tuple[torch.Tensor, ...]:
    """Train and validation splits (80/20, one fixed shuffle), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16  # [1797, 64]
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def batches(x: torch.Tensor, y: torch.Tensor, rows: int, seed: int) -> Iterator[tuple]:
    """The seed's batches, epoch after epoch (each a fresh permutation): the same everywhere."""
    generator = torch.Generator().manual_seed(1000 + seed)
    while True:
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x) - rows + 1, rows):
            index = order[start : start + rows]
            yield x[index], y[index]


def link_bytes() -> int:
    """Bytes this host has sent over the link (its veth's tx counter)."""
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


class DDPTrainer:
    """torch DDP: each rank runs half of every batch; all-reduce overlapped, default buckets."""

    def __init__(self, task: Task, seed: int, example: torch.Tensor) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.model = task.model(seed)
        self.ddp = nn.parallel.DistributedDataParallel(self.model)
        self.opt = task.optimizer(list(self.ddp.parameters()))
        self.share = task.rows // self.world

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.rank * self.share : (self.rank + 1) * self.share]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(self.ddp(self.mine(x)), self.mine(y))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def flush(self) -> None:
        pass

    def accuracy(self, vx: torch.Tensor, vy: torch.Tensor) -> float:
        """Every rank holds the whole model: each evaluates locally."""
        with torch.no_grad():
            self.model.eval()
            correct = (self.model(vx).argmax(1) == vy).float().mean().item()
            self.model.train()
        return correct

    def describe(self) -> dict:
        return {"plan": None}

    def probe(self, x: torch.Tensor, y: torch.Tensor, repeats: int = 5) -> dict:
        """DDP's compute per step (no all-reduce: `no_sync`) and the all-reduce of its
        gradients' size alone (one flat tensor), median seconds: the regime's ratio."""
        compute, allreduce = [], []
        grads = torch.zeros(sum(p.numel() for p in self.model.parameters()))
        for _ in range(repeats):
            start = time.perf_counter()
            with self.ddp.no_sync():
                self.step(x, y)
            compute.append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(grads)
            allreduce.append(time.perf_counter() - start)
        return {"compute_s": statistics.median(compute),
                "allreduce_s": statistics.median(allreduce),
                "gradient_bytes": grads.numel() * grads.element_size()}  # fmt: skip

    def close(self) -> None:
        pass


class CompileTrainer:
    """`pdcompile.compile` with the method's arguments."""

    def __init__(self, task: Task, seed: int, example: tuple, method: str, cluster: str | None):
        import pdcompile

        x, y = example  # one step's rows
        kwargs: dict = {"schedule": method}
        if method.startswith("auto"):  # as a user calls it: the rows per step, nothing else
            kwargs = {"schedule": "auto", "global_batch_size": task.rows}
        else:  # the example is one microbatch
            kwargs["num_microbatches"] = NAMED_MICROBATCHES
            x, y = x[: task.rows // NAMED_MICROBATCHES], y[: task.rows // NAMED_MICROBATCHES]
        if cluster and method != "auto":
            kwargs["cluster"] = cluster
        self.pipe = pdcompile.compile(
            task.model(seed), (x,), example_targets=y, loss_fn=F.cross_entropy,
            optimizer=task.optimizer, **kwargs,
        )  # fmt: skip

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.pipe.train_step(x, y)

    def flush(self) -> None:
        self.pipe.flush()  # `pipedream`'s minibatches in flight: training, before evaluating

    def accuracy(self, vx: torch.Tensor, vy: torch.Tensor) -> float:
        """The last stage's rank has the outputs; -1 elsewhere (the caller takes the max)."""
        out = self.pipe.eval_step(vx)
        return -1.0 if out is None else (out.argmax(1) == vy).float().mean().item()

    def describe(self) -> dict:
        plan = self.pipe.plan  # re-scored for the rows each microbatch ran
        return {
            "plan": {
                "stages": [{"nodes": [s.nodes[0], s.nodes[-1]], "num_nodes": len(s.nodes),
                            "ranks": list(s.ranks)} for s in plan.stages],
                "schedule": plan.schedule, "num_microbatches": plan.num_microbatches,
                "step_time": plan.step_time, "data_parallel_time": plan.data_parallel_time,
                "cluster": str(plan.cluster), "cluster_dict": plan.cluster.to_dict(),
            },
        }  # fmt: skip

    def close(self) -> None:
        self.pipe.close()


def run_seed(args: argparse.Namespace, task: Task, seed: int, data: tuple) -> dict:
    """Train one seed to the target (or the cap); return this rank's record."""
    x, y, vx, vy = data
    stream = batches(x, y, task.rows, seed)
    first = next(batches(x, y, task.rows, seed))
    if args.method == "ddp":
        trainer = DDPTrainer(task, seed, first[0])
    else:
        trainer = CompileTrainer(task, seed, first, args.method, args.cluster)
    record = {"seed": seed, "evals": [], "step_s": [], "train_s": 0.0, "eval_s": 0.0,
              "train_bytes": 0, "eval_bytes": 0, "reached": None}  # fmt: skip
    dist.barrier()
    for step in range(1, args.max_steps + 1):
        bytes_before, start = link_bytes(), time.perf_counter()
        trainer.step(*next(stream))
        if step % args.eval_every == 0:
            trainer.flush()
        record["step_s"].append(time.perf_counter() - start)
        record["train_s"] += record["step_s"][-1]
        record["train_bytes"] += link_bytes() - bytes_before
        if step % args.eval_every and step < args.max_steps:
            continue
        accuracy, stop = evaluate(trainer, vx, vy, record, args)
        record["evals"].append({"step": step, "samples": step * task.rows,
                                "accuracy": accuracy, "train_s": record["train_s"],
                                "eval_s": record["eval_s"]})  # fmt: skip
        if accuracy >= args.target:
            record["reached"] = record["evals"][-1]
            break
        if stop:
            break
    record["steps"] = step
    record.update(trainer.describe())
    if args.method == "ddp":
        record["probe"] = trainer.probe(*first)
    trainer.close()
    return record


def evaluate(trainer, vx, vy, record: dict, args: argparse.Namespace) -> tuple[float, bool]:
    """The validation accuracy, the same on every rank, and whether to stop (rank 0's clock
    past the cap): one all-reduce carries both, so every rank decides alike."""
    bytes_before, start = link_bytes(), time.perf_counter()
    over = float(dist.get_rank() == 0 and record["train_s"] > args.max_train_s)
    both = torch.tensor([trainer.accuracy(vx, vy), over])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    record["eval_s"] += time.perf_counter() - start
    record["eval_bytes"] += link_bytes() - bytes_before
    return both[0].item(), bool(both[1].item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--cluster", help="passed to compile by every method but `auto`")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-train-s", type=float, default=240.0)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--rows", type=int, default=Task.rows, help="rows per step")
    parser.add_argument("--width", type=int, default=Task.width)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if args.method == "ddp":
        dist.init_process_group("gloo")
    task, data = Task(width=args.width, rows=args.rows), digits()
    for seed in map(int, args.seeds.split(",")):
        record = run_seed(args, task, seed, data)
        record.update(method=args.method, rank=rank, task=asdict(task),
                      cores=sorted(os.sched_getaffinity(0)),
                      threads=torch.get_num_threads())  # fmt: skip
        path = Path(args.out) / f"seed{seed}-rank{rank}.json"
        path.write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
