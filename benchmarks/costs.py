"""Fidelity of the cost passes, with the per-operation framework cost folded in and not.

Models: the zoo's MLP, residual CNN and GPT-style decoder; four overhead-heavy ones written here
(many small nodes: a stack of 48 Linear(8, 8) + ReLU, a small U-Net, a small Inception-style CNN,
a tied-embedding MLP), a mixed one (two wide Linear layers, then 40 tiny Linear + ReLU) and
two compute-heavy ones (a wide MLP, a wide CNN). Per round, one CPU
thread, the models in turn (their order reversed every other round):

- calibrate the framework cost (`pdcompile.calibrate`, not cached: this round's machine);
- profile (cache off) once; the times with the fold (`calibration=` that calibration) and
  without (the same profile's `pdcompile.measured_s`), and the analytic times with and without;
- measured step: the median of whole training steps (forward and backward) of the unmodified
  model on the same batch, timed just before and just after the profile (their mean: this
  machine's cores change speed from one second to the next);
- ratio = sum of node forward + backward / measured step (the target is within 15%);
- stages: the graph cut in two at its middle node (`torch.fx.passes.split_module`), each part run
  as a pipeline stage would (forward, then backward from the gradients the next part sent),
  timed apart; ratio per stage = its nodes' profiled sum / its measured time. The fold moves
  time between nodes, not the total, so this is where it shows.

The table gives each ratio's median over the rounds and its range (min-max) as the spread.

    python benchmarks/costs.py [--rounds 5] [--repeats 30] [--models a,b] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.fx.passes.split_module import split_module

import pdcompile
from pdcompile.core.ir import MEASURED_S
from pdcompile.graph.node_runner import COMPUTE_OPS


class TinyStack(nn.Module):
    """48 x (Linear(8, 8), ReLU) on 4 rows: every node is mostly framework."""

    def __init__(self, depth: int = 48) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(m for _ in range(depth) for m in (nn.Linear(8, 8), nn.ReLU()))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU(),
    )  # fmt: skip


class SmallUNet(nn.Module):
    """Three levels, 8-32 channels, 16 x 16 images: skips concatenated, transposed convs up."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.d1, self.d2, self.d3 = _block(3, c), _block(c, 2 * c), _block(2 * c, 4 * c)
        self.u2, self.b2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2), _block(4 * c, 2 * c)
        self.u1, self.b1 = nn.ConvTranspose2d(2 * c, c, 2, stride=2), _block(2 * c, c)
        self.head = nn.Conv2d(c, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.d1(x)  # [B, c, 16, 16]
        b = self.d2(F.max_pool2d(a, 2))  # [B, 2c, 8, 8]
        c = self.d3(F.max_pool2d(b, 2))  # [B, 4c, 4, 4]
        b = self.b2(torch.cat([self.u2(c), b], 1))
        a = self.b1(torch.cat([self.u1(b), a], 1))
        return self.head(a)


class SmallInception(nn.Module):
    """Four Inception blocks of four branches (1x1; 1x1-3x3; 1x1-5x5; pool-1x1) on 8 x 8."""

    def __init__(self, c: int = 16, blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        q = c // 4
        self.blocks = nn.ModuleList(
            nn.ModuleDict({
                "a": nn.Conv2d(c, q, 1), "b1": nn.Conv2d(c, q, 1),
                "b2": nn.Conv2d(q, q, 3, padding=1), "c1": nn.Conv2d(c, q, 1),
                "c2": nn.Conv2d(q, q, 5, padding=2), "d": nn.Conv2d(c, q, 1),
            })
            for _ in range(blocks)
        )  # fmt: skip
        self.fc = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        for m in self.blocks:
            x = torch.cat([
                F.relu(m["a"](x)), F.relu(m["b2"](F.relu(m["b1"](x)))),
                F.relu(m["c2"](F.relu(m["c1"](x)))), F.relu(m["d"](F.max_pool2d(x, 3, 1, 1))),
            ], 1)  # fmt: skip
        return self.fc(x.mean((2, 3)))


class TiedMLP(nn.Module):
    """Embedding, six residual Linear + GELU, LayerNorm, a head tied to the embedding."""

    def __init__(self, vocab: int = 256, dim: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)  # [B, T, dim]
        for layer in self.layers:
            h = h + F.gelu(layer(h))
        return self.norm(h) @ self.emb.weight.t()  # [B, T, vocab]


def heavy_then_light() -> tuple[nn.Module, tuple]:
    """Two Linear(512, 512) on 64 rows, then 40 x (Linear(8, 8), ReLU): a cut in the middle
    puts the heavy half and some light nodes on stage 0, light nodes alone on stage 1."""
    light = ((nn.Linear(8, 8), nn.ReLU()) for _ in range(40))
    model = nn.Sequential(
        nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8),
        *(m for pair in light for m in pair),
    )  # fmt: skip
    return model, (torch.randn(64, 512),)


def _seeded(build: Callable[[], tuple[nn.Module, tuple]]) -> Callable[[], tuple]:
    def make() -> tuple[nn.Module, tuple]:
        torch.manual_seed(0)
        return build()

    return make


MODELS: dict[str, tuple[str, Callable[[], tuple]]] = {
    "mlp": ("zoo", lambda: pdcompile.zoo.mlp()[:2]),
    "resnet": ("zoo", lambda: pdcompile.zoo.resnet()[:2]),
    "gpt": ("zoo", lambda: pdcompile.zoo.gpt()[:2]),
    "tiny-stack": ("overhead", _seeded(lambda: (TinyStack(), (torch.randn(4, 8),)))),
    "unet": ("overhead", _seeded(lambda: (SmallUNet(), (torch.randn(2, 3, 16, 16),)))),
    "inception": ("overhead", _seeded(lambda: (SmallInception(), (torch.randn(2, 3, 8, 8),)))),
    "tied-mlp": ("overhead", _seeded(lambda: (TiedMLP(), (torch.randint(0, 256, (4, 16)),)))),
    "heavy-light": ("mixed", _seeded(heavy_then_light)),
    "wide-mlp": ("compute", _seeded(lambda: (
        nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 256)), (torch.randn(128, 1024),)))),
    "wide-cnn": ("compute", _seeded(lambda: (
        nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
                      nn.ReLU(), nn.Conv2d(64, 32, 3, padding=1)), (torch.randn(8, 32, 32, 32),)))),
}  # fmt: skip


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(x: list[float]) -> np.ndarray:
        values = np.asarray(x)
        order = values.argsort(kind="stable")
        r = np.empty(len(values))
        r[order] = np.arange(len(values))
        for v in np.unique(values):  # ties share their average rank
            r[values == v] = r[values == v].mean()
        return r

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1]) if len(a) > 1 else float("nan")


def step_time(model: nn.Module, inputs: tuple, repeats: int) -> float:
    times = []
    for _ in range(3 + repeats):
        start = time.perf_counter()
        out = model(*inputs)
        out.float().sum().backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[3:])


def halves(gm: fx.GraphModule) -> dict[str, int]:
    """Stage 0 or 1 of every node: the compute nodes cut at the middle one; placeholders go with
    their first user, `get_attr` nodes too (split_module copies them where used)."""
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    stage = {n.name: int(i >= len(compute) // 2) for i, n in enumerate(compute)}
    for n in gm.graph.nodes:
        if n.name not in stage:
            users = [stage[u.name] for u in n.users if u.name in stage]
            stage[n.name] = min(users, default=1)
    return stage


class _Stages(fx.Interpreter):
    """Runs the split graph, timing each part's forward; the second part's inputs that carry
    gradient arrive as fresh leaves, as a receiving stage's do."""

    def __init__(self, split: fx.GraphModule) -> None:
        super().__init__(split)
        self.spent = [0.0, 0.0]
        self.sent: list[torch.Tensor] = []
        self.received: list[torch.Tensor] = []

    def call_module(self, target, args, kwargs):  # noqa: ANN001, ANN201
        first = target == "submod_0"
        if not first:
            fresh = []
            for a in args:
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    self.sent.append(a)
                    a = a.detach().requires_grad_()
                    self.received.append(a)
                fresh.append(a)
            args = tuple(fresh)
        start = time.perf_counter()
        value = super().call_module(target, args, kwargs)
        self.spent[0 if first else 1] += time.perf_counter() - start
        return value


def stage_times(gm: fx.GraphModule, stage: dict[str, int], inputs: tuple, repeats: int) -> list:
    """Median seconds of each half run as a pipeline stage: forward, then backward from the
    gradients of what it sent (the second half's inputs made leaves, as a receiving stage's)."""
    split = split_module(gm, gm, lambda n: stage[n.name])
    subs = [n.target for n in split.graph.nodes if n.op == "call_module"]
    assert subs == ["submod_0", "submod_1"], subs
    times: list[list[float]] = [[], []]
    for r in range(3 + repeats):
        run = _Stages(split)
        out = run.run(*inputs)
        start = time.perf_counter()
        out.float().sum().backward()
        run.spent[1] += time.perf_counter() - start
        pairs = [
            (s, g.grad) for s, g in zip(run.sent, run.received, strict=True) if g.grad is not None
        ]
        start = time.perf_counter()
        if pairs:
            torch.autograd.backward([s for s, _ in pairs], [g for _, g in pairs])
        run.spent[0] += time.perf_counter() - start
        split.zero_grad(set_to_none=True)
        if r >= 3:
            times[0].append(run.spent[0])
            times[1].append(run.spent[1])
    return [statistics.median(t) for t in times]


def measure(name: str, cost: pdcompile.FrameworkCost, repeats: int) -> dict:
    kind, build = MODELS[name]
    model, inputs = build()
    gm = pdcompile.trace(model, inputs)
    before = step_time(model, inputs, repeats)  # the step is timed on both sides of the profile
    start = time.perf_counter()
    on = pdcompile.analyze(gm, inputs, cache=False, progress=False, calibration=cost)
    profile_s = time.perf_counter() - start
    off = {n.name: sum(n.meta[MEASURED_S]) for n in gm.graph.nodes}  # the same profile, unfolded
    analytic = {
        c: pdcompile.analyze(gm, inputs, profile=False, calibration=cost if c else False)
        for c in (True, False)
    }
    nodes = on.graph.nodes
    profiled = {n: nodes[n]["forward_s"] + nodes[n]["backward_s"] for n in on.nodes}
    stage = halves(gm)
    measured_stages = stage_times(gm, stage, inputs, repeats)
    measured = (before + step_time(model, inputs, repeats)) / 2

    def ratios(times: dict[str, float]) -> dict[str, float]:
        per_stage = [math.fsum(t for n, t in times.items() if stage[n] == s) for s in (0, 1)]
        return {
            "ratio": math.fsum(times.values()) / measured,
            "stage0": per_stage[0] / measured_stages[0],
            "stage1": per_stage[1] / measured_stages[1],
        }

    def summed(graph: pdcompile.CostGraph) -> dict[str, float]:
        return {n: graph.graph.nodes[n]["forward_s"] + graph.graph.nodes[n]["backward_s"]
                for n in graph.nodes}  # fmt: skip

    total = sum(profiled.values())
    large, covered = [], 0.0
    for n in sorted(profiled, key=profiled.get, reverse=True):
        if covered >= 0.8 * total:
            break
        large.append(n)
        covered += profiled[n]
    estimates = summed(analytic[True])
    return {
        "model": name,
        "kind": kind,
        "nodes": len(on.nodes),
        "measured_step_s": measured,
        "measured_stages_s": measured_stages,
        "profiled_on_s": total,
        "profiled_off_s": math.fsum(off.values()),
        "profile_on": ratios(profiled),
        "profile_off": ratios(off),
        "analytic_on": ratios(estimates),
        "analytic_off": ratios(summed(analytic[False])),
        "framework_scale": on.meta["framework"]["scale"],
        "spearman_analytic_vs_profiled": spearman(
            [estimates[n] for n in large], [profiled[n] for n in large]
        ),
        "profile_wall_s": profile_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="rounds (medians over them)")
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    names = args.models.split(",")
    torch.set_num_threads(1)
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    calibrations = []
    for r in range(args.rounds):
        cost = pdcompile.calibrate(num_threads=1, cache=False, refresh=True)
        calibrations.append(cost.to_dict())
        for name in names if r % 2 == 0 else reversed(names):
            rounds[name].append(measure(name, cost, args.repeats))

    def spread(key: str) -> str:
        values = [c[key] * 1e6 for c in calibrations]
        return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

    title = (
        f"profiled / measured, 1 CPU thread, median [min-max] of {args.rounds} rounds; framework "
        f"cost (us) {spread('forward_op_s')} per op forward, {spread('backward_node_s')} per "
        f"node and {spread('backward_op_s')} per op backward"
    )
    table = Table(title=title)
    for column in ("model", "kind", "nodes", "step", "profile off", "profile on",
                   "analytic off", "analytic on", "stages off", "stages on"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("model", "kind") else "right")

    def cell(results: list[dict], key: str, ratio: str) -> str:
        values = [r[key][ratio] for r in results]
        return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

    def stages(results: list[dict], key: str) -> str:
        return " / ".join(
            f"{statistics.median(r[key][s] for r in results):.2f}" for s in ("stage0", "stage1")
        )

    for name, results in rounds.items():
        step = statistics.median(r["measured_step_s"] for r in results)
        table.add_row(
            name, results[0]["kind"], str(results[0]["nodes"]), f"{step * 1e3:.2f} ms",
            cell(results, "profile_off", "ratio"), cell(results, "profile_on", "ratio"),
            cell(results, "analytic_off", "ratio"), cell(results, "analytic_on", "ratio"),
            stages(results, "profile_off"), stages(results, "profile_on"),
        )  # fmt: skip
    table.caption = (
        "profile: the sum of the nodes' profiled forward + backward; analytic: the roofline "
        "(cpu preset), on = its per-node overhead replaced by the counted operations' calibrated "
        "cost; stages: each half's profiled sum / its measured time as a pipeline stage"
    )
    Console(width=200).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calibrations": calibrations, "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()
