"""A whole training step predicted with and without the loss and the optimizer step priced.

For the zoo's MLP and GPT-style decoder and a heavy-head token model (a 16k-class head under
cross-entropy, where the loss is the heaviest single operation), in one process at one CPU
thread:
- measured: the median of a training step of the unmodified model, as a stage runs it
  (forward, loss, backward, `optimizer.step()`, `zero_grad(set_to_none=True)`);
- predicted, priced: `simulate`'s step of a one-stage plan (one microbatch) on
  `pdcompile.analyze(..., loss_fn=, targets=, optimizer=factory)`: the nodes' forward and
  backward, the loss and the optimizer's step;
- predicted, not priced: the same plan on the same CostGraph with the loss and the optimizer
  step taken out (what a plan predicted before they were priced).
Each round profiles every model afresh (cache off) and measures its step right after, the
models alternating; the table gives the median over rounds of each ratio predicted / measured
and its range.

    python benchmarks/step_costs.py [--rounds 5] [--repeats 20] [--optimizer adam|sgd]
                                    [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from torch import nn

import pdcompile
from pdcompile import CostGraph, Plan
from pdcompile.passes.planning.plans import Stage

MODELS = ("mlp", "gpt", "heavy-head")
OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
}


class TokenHead(nn.Module):
    """Tokens -> embedding -> two GELU MLP blocks -> a head onto 16384 classes."""

    def __init__(self, vocab: int = 16384, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.GELU()
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, vocab]
        return self.head(self.body(self.embed(tokens)))


def token_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), targets.flatten())


def case(name: str) -> tuple[nn.Module, tuple, Any, Callable]:
    """(model, example inputs, targets, loss_fn)."""
    torch.manual_seed(0)
    if name == "mlp":
        model, inputs = pdcompile.zoo.mlp()[:2]
        targets = torch.randint(0, 10, (inputs[0].shape[0],))
        return model, inputs, targets, F.cross_entropy
    if name == "gpt":
        model, inputs = pdcompile.zoo.gpt()[:2]
        vocab = model.cfg.vocab_size
        return model, inputs, torch.randint(0, vocab, inputs[0].shape), token_loss
    model = TokenHead().train()
    tokens = torch.randint(0, 16384, (8, 32))
    return model, (tokens,), torch.randint(0, 16384, (8, 32)), token_loss


def measured_step(
    model: nn.Module, inputs: tuple, targets: Any, loss_fn: Callable, factory: Callable,
    repeats: int,
) -> float:  # fmt: skip
    """Median seconds of a training step as a stage runs it."""
    optimizer = factory(list(model.parameters()))
    times = []
    for _ in range(3 + repeats):
        start = time.perf_counter()
        loss_fn(model(*inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def unpriced(costs: CostGraph) -> CostGraph:
    """The same costs without the loss and the optimizer step."""
    graph = costs.graph.copy()
    for _, data in graph.nodes(data=True):
        data["optimizer_s"] = 0.0
    return CostGraph(graph, costs.batch_size, costs.meta)


def predicted_step(costs: CostGraph) -> float:
    """`simulate`'s step of one stage holding every node, one microbatch."""
    stage = Stage(index=0, nodes=tuple(costs.nodes), replicas=1, ranks=(0,))
    plan = Plan(stages=(stage,), cluster="1", schedule="1f1b", num_microbatches=1)
    return pdcompile.evaluate(plan, costs).step_time


def one_round(name: str, factory: Callable, repeats: int) -> dict:
    model, inputs, targets, loss_fn = case(name)
    gm = pdcompile.trace(model, inputs)
    costs = pdcompile.analyze(
        gm, inputs, loss_fn=loss_fn, targets=targets, optimizer=factory, cache=False,
        progress=False,
    )  # fmt: skip
    measured = measured_step(model, inputs, targets, loss_fn, factory, repeats)
    totals = costs.totals()
    return {
        "model": name,
        "measured_s": measured,
        "priced_s": predicted_step(costs),
        "unpriced_s": predicted_step(unpriced(costs)),
        "nodes_s": totals["forward_s"] + totals["backward_s"],
        "loss_s": costs.loss_s,
        # the nodes' steps and the optimizer's one call, as `evaluate` prices a stage's update
        "optimizer_s": totals["optimizer_s"] + costs.meta.get("optimizer_call_s", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per measurement")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--json", help="write every round here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    factory = OPTIMIZERS[args.optimizer]
    rounds: dict[str, list[dict]] = {name: [] for name in MODELS}
    for _ in range(args.rounds):
        for name in MODELS:  # the models alternate within each round
            rounds[name].append(one_round(name, factory, args.repeats))
    table = Table(
        title=escape(
            f"training step, one process, one thread, {args.optimizer}: predicted / measured "
            f"(median over {args.rounds} rounds, [min, max])"
        )
    )
    for column in ("model", "measured", "nodes", "loss", "optimizer", "priced", "not priced"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for name, runs in rounds.items():

        def median(key: str, runs: list[dict] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        def ratio(key: str, runs: list[dict] = runs) -> str:
            values = [r[key] / r["measured_s"] for r in runs]
            return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"

        table.add_row(
            name, f"{median('measured_s') * 1e3:.2f} ms", f"{median('nodes_s') * 1e3:.2f} ms",
            f"{median('loss_s') * 1e3:.2f} ms", f"{median('optimizer_s') * 1e3:.2f} ms",
            ratio("priced_s"), ratio("unpriced_s"),
        )  # fmt: skip
    Console(width=150).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds, f, indent=1)


if __name__ == "__main__":
    main()
