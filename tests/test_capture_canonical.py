"""Capture is the same in every process: canonical order and names (capture/canonical.py), and
ranks whose graphs still differ are told where (capture/graph_diff.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from spawn import run_ranks

import pdcompile
from pdcompile.core.errors import PdcompileError
from pdcompile.runtime.distributed import init_process_group

HERE = Path(__file__).resolve().parent


class Branches(nn.Module):
    """Two independent branches run in the order of `order` (as a set of strings would)."""

    def __init__(self, order: tuple[str, ...], p: float = 0.0) -> None:
        super().__init__()
        self.order, self.p = order, p
        self.proj = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)})
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = {}
        for key in self.order:
            out[key] = self.proj[key](x).sin()
            if self.p:  # random draws keep their order: they are left out when not needed
                out[key] = F.dropout(out[key], self.p, self.training)
        self.steps.add_(1)  # a buffer write: it stays where it was
        return out["a"] * 2 + out["b"]


def test_the_order_python_runs_independent_branches_in_does_not_change_the_graph() -> None:
    codes = set()
    for order in (("a", "b"), ("b", "a")):
        torch.manual_seed(0)
        model = Branches(order)
        for method in ("fx", "export"):
            gm = pdcompile.trace(model, (torch.randn(4, 8),), method=method)
            codes.add((method, gm.code))
    assert len({code for method, code in codes if method == "fx"}) == 1
    assert len({code for method, code in codes if method == "export"}) == 1


def test_random_operations_keep_their_order_so_the_graph_equals_the_model() -> None:
    # trace compares the graph's output with the model's under one seed: with dropout in both
    # branches, any reordering of the two draws would fail that check
    for order in (("a", "b"), ("b", "a")):
        model = Branches(order, p=0.5).train()
        gm = pdcompile.trace(model, (torch.randn(4, 8),), method="fx")
        draws = [n.args[0].args[0].target for n in gm.graph.nodes
                 if n.op == "call_function" and n.target is F.dropout]  # fmt: skip
        assert draws == [f"proj.{k}" for k in order]


_SET_MODEL = """
import hashlib, sys, torch, torch.nn as nn, pdcompile
sys.path.insert(0, {here!r})
from test_capture_canonical import Branches
class FromSet(Branches):
    def __init__(self):
        super().__init__(tuple(set(["a", "b"])))  # the order follows the hash seed
torch.manual_seed(0)
gm = pdcompile.trace(FromSet(), (torch.randn(4, 8),))
print(hash("a") % 1000, hashlib.sha256(gm.code.encode()).hexdigest())
"""


def test_processes_with_different_hash_seeds_capture_one_graph() -> None:
    script = _SET_MODEL.format(here=str(HERE))
    seen = []
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=120, check=True).stdout.split()  # fmt: skip
        seen.append(out)
    assert len({s[0] for s in seen}) > 1, "the seeds should give different string hashes"
    assert len({s[1] for s in seen}) == 1, seen


class Scaled(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor
        self.net = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * self.factor)


def _different_code(rank: int, world_size: int, init_file: str) -> str:
    init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    torch.manual_seed(0)
    model = Scaled(2.0 if rank == 0 else 3.0)  # the same tensors, other code
    try:
        sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
        pdcompile.compile(model, (torch.randn(4, 8),), loss_fn=F.cross_entropy, optimizer=sgd,
                          profile=False)  # fmt: skip
    except PdcompileError as exc:
        return str(exc)
    return "no error"


def test_ranks_whose_graphs_differ_are_told_the_first_node_and_its_line() -> None:
    messages = run_ranks(_different_code, 2, timeout_s=120)
    for message in messages:
        assert "ranks [1] captured another model or call than rank 0" in message
        assert "on rank 0 but" in message and "mul" in message, message
        assert "test_capture_canonical.py" in message and "x * self.factor" in message
        assert "PYTHONHASHSEED" in message
