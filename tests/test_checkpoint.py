"""Checkpoints (`runtime/checkpoint.py`): round trips, resharding across ranks, errors.

Stage modules stand in for a pipeline's: copies of an original model that keep some of its
submodules, under their original names. A stage's gradients are the original model's (one
process computes them whole), so stage optimizers follow an unpipelined reference exactly. The
spawned groups save under one split of the model and load under another; the parent compares
every name with the reference.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from spawn import run_ranks
from torch.distributed.checkpoint import FileSystemReader

import pdcompile
from pdcompile.core.errors import CheckpointError
from pdcompile.runtime import checkpoint
from pdcompile.runtime.distributed import init_process_group
from pdcompile.zoo import MLP

LR = 0.01
SAVE_SPLIT = [("net.0", "net.3", "shared", "tail"), ("net.6", "net.9", "shared", "tail")]
LOAD_SPLIT = [("net.0", "shared"), ("net.3", "net.6"), ("net.9", "tail")]


class Tied(nn.Module):
    """The zoo MLP, then `shared` and `tail`: linears with one weight (like wte and lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(p=0.0).net
        self.shared = nn.Linear(10, 10, bias=False)
        self.tail = nn.Linear(10, 10)
        self.tail.weight = self.shared.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(torch.tanh(self.shared(self.net(x))))  # [B, 32] -> [B, 10]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 32, generator=gen), torch.randn(8, 10, generator=gen)


def original(seed: int = 0) -> Tied:
    torch.manual_seed(seed)
    return Tied()


def stage_module(model: nn.Module, keep: tuple[str, ...]) -> nn.Module:
    """A copy of `model` without the submodules holding parameters that are not in `keep`."""
    stage = copy.deepcopy(model)
    for name, module in list(stage.named_modules()):
        if name and module._parameters and name not in keep:
            parent, _, child = name.rpartition(".")
            del stage.get_submodule(parent)._modules[child]
    return stage


def step(full: nn.Module, optimizers: list[tuple[nn.Module, torch.optim.Optimizer]]) -> None:
    """One update of each (module, optimizer) with the gradients of `full` at its values."""
    full.zero_grad()
    x, y = batch()
    F.mse_loss(full(x), y).backward()
    for module, optimizer in optimizers:
        for name, param in module.named_parameters():
            param.grad = full.get_parameter(name).grad.clone()
        optimizer.step()


def reference() -> tuple[list[dict[str, torch.Tensor]], list[dict[str, dict]]]:
    """The unpipelined run: 2 Adam steps, lr halved, a 3rd step; the model's and the optimizer's
    state (by name) before and after each step. One thread, as the spawned ranks use: the same
    float results."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference()
    finally:
        torch.set_num_threads(threads)


def _reference() -> tuple[list[dict[str, torch.Tensor]], list[dict[str, dict]]]:
    full = original()
    adam = torch.optim.Adam(full.parameters(), lr=LR)
    states, optimizer_states = [clone(full.state_dict())], [{}]
    for k in range(3):
        if k == 2:
            adam.param_groups[0]["lr"] = LR / 2
        step(full, [(full, adam)])
        states.append(clone(full.state_dict()))
        optimizer_states.append(optimizer_state(full, adam))
    return states, optimizer_states


def clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """The optimizer's per-parameter state by the module's parameter names."""
    return {
        name: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        for name, param in module.named_parameters(remove_duplicate=False)
        if (state := optimizer.state.get(param))
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name


# single process -------------------------------------------------------------------------------

OPTIMIZERS = {
    "sgd": lambda m, lr: torch.optim.SGD(
        [{"params": m.net[0].parameters(), "lr": 2 * lr}, {"params": m.net[3:].parameters()}],
        lr=lr, momentum=0.9, nesterov=True,
    ),
    "adam": lambda m, lr: torch.optim.Adam(
        m.parameters(), lr=lr, betas=(0.8, 0.9), weight_decay=0.1,
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_round_trip_continues_like_an_uninterrupted_run(kind: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP(p=0.0)
    optimizer = OPTIMIZERS[kind](model, LR)
    x, y = torch.randn(8, 32), torch.randn(8, 10)

    def update(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    for _ in range(2):
        update(model, optimizer)
    for group in optimizer.param_groups:
        group["lr"] /= 2  # as an LR scheduler would
    extra = {"step": 2, "loss": 0.1 + 0.2, "flag": True, "ids": torch.arange(3)}
    checkpoint.save(
        tmp_path, model=model, optimizer=optimizer, extra={**extra, **checkpoint.rng_state()}
    )
    saved = clone(model.state_dict())
    after_save = torch.randn(4)
    update(model, optimizer)

    torch.manual_seed(1)
    fresh = MLP(p=0.0)
    fresh_optimizer = OPTIMIZERS[kind](fresh, 3 * LR)
    loaded = checkpoint.load(tmp_path, model=fresh, optimizer=fresh_optimizer)
    assert_same(fresh.state_dict(), saved)
    want = [g["lr"] for g in optimizer.param_groups]
    assert [g["lr"] for g in fresh_optimizer.param_groups] == want
    assert [type(g["betas"]) for g in fresh_optimizer.param_groups if "betas" in g] in ([], [tuple])
    assert {k: loaded[k] for k in ("step", "loss", "flag")} == {
        k: extra[k] for k in extra if k != "ids"
    }
    assert type(loaded["step"]) is int and torch.equal(loaded["ids"], extra["ids"])
    checkpoint.set_rng_state(loaded)
    assert torch.equal(torch.randn(4), after_save)
    update(fresh, fresh_optimizer)
    assert_same(fresh.state_dict(), model.state_dict())


def test_full_state_dict_of_a_single_process_checkpoint(tmp_path: Path) -> None:
    model = original()
    checkpoint.save(tmp_path, model=model, optimizer=None, extra={})
    full = pdcompile.load_full_state_dict(tmp_path)
    assert pdcompile.load_full_state_dict is checkpoint.load_full_state_dict
    assert sorted(full) == sorted(model.state_dict())  # tail.weight, the alias, included
    assert_same(full, model.state_dict())
    fresh = original(seed=5)
    fresh.load_state_dict(full, strict=True)
    assert_same(fresh.state_dict(), model.state_dict())


def test_errors_name_the_directory_the_name_and_the_shapes(tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    checkpoint.save(saved, model=MLP(p=0.0), optimizer=None, extra={})

    grown = MLP(p=0.0)
    grown.register_buffer("scale", torch.ones(3))
    with pytest.raises(CheckpointError, match=rf"no 'scale'.*{saved}|{saved}.*no 'scale'"):
        checkpoint.load(saved, model=grown)

    with pytest.raises(CheckpointError) as info:
        checkpoint.load(saved, model=MLP(d_hidden=48, p=0.0))
    assert "'net.0.weight' is [64, 32] in the checkpoint but [48, 32]" in str(info.value)

    with torch.device("meta"):
        unmaterialised = MLP(p=0.0)
    with pytest.raises(CheckpointError, match="'net.0.weight' is on the meta device"):
        checkpoint.load(saved, model=unmaterialised)

    truncated = tmp_path / "truncated"
    checkpoint.save(truncated, model=MLP(p=0.0), optimizer=None, extra={})
    (data,) = truncated.glob("*.distcp")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"checkpoint {truncated}: reading failed: rank 0: "):
        checkpoint.load(truncated, model=MLP(p=0.0))

    with pytest.raises(CheckpointError, match="saved without an optimizer"):
        model = MLP(p=0.0)
        checkpoint.load(saved, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1))

    empty = tmp_path / "empty"
    empty.mkdir()
    for call in (lambda: checkpoint.load(empty, model=MLP()), lambda: load_full(empty)):
        with pytest.raises(CheckpointError, match=f"checkpoint {empty}: not a checkpoint"):
            call()

    foreign = tmp_path / "foreign"
    with pytest.warns(UserWarning):  # DCP: no process group, so a single-process save
        dcp.save({"w": torch.ones(2)}, checkpoint_id=foreign)
    with pytest.raises(CheckpointError, match=f"{foreign}: a torch.distributed.checkpoint dir"):
        load_full(foreign)

    with pytest.raises(CheckpointError, match=r"extra\['name'\] is a str"):
        checkpoint.save(tmp_path / "bad", model=MLP(), optimizer=None, extra={"name": "run1"})
    assert not (tmp_path / "bad" / ".metadata").exists()


def load_full(directory: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load_full_state_dict(directory)


# spawned ranks --------------------------------------------------------------------------------


def _save_two(rank: int, world_size: int, init_file: str, root: str) -> dict:
    """Save stage A (rank 0) or B (rank 1), both holding the tied `shared`/`tail` weight."""
    init_process_group(rank, world_size, init_file=init_file, backend="gloo", timeout_s=60)
    full = original()
    full_adam = torch.optim.Adam(full.parameters(), lr=LR)
    stage = stage_module(full, SAVE_SPLIT[rank])
    adam = torch.optim.Adam(stage.parameters(), lr=LR)
    for _ in range(2):
        step(full, [(stage, adam), (full, full_adam)])
    adam.param_groups[0]["lr"] = LR / 2
    extra = {"step": 2, "rank": rank, **checkpoint.rng_state()}
    checkpoint.save(os.path.join(root, "two"), model=stage, optimizer=adam, extra=extra)
    with torch.no_grad():
        stage.get_parameter("shared.weight")[0, 0] += rank  # replicas that disagree
    try:
        checkpoint.save(os.path.join(root, "bad"), model=stage, optimizer=None, extra={})
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return {"names": sorted(stage.state_dict()), "error": error}


def _load_three(rank: int, world_size: int, init_file: str, root: str) -> dict:
    """Load another split of the model from the 2-rank checkpoint; step; save and reload."""
    init_process_group(rank, world_size, init_file=init_file, backend="gloo", timeout_s=60)
    out: dict = {}
    stage = stage_module(original(seed=7), LOAD_SPLIT[rank])
    adam = torch.optim.Adam(stage.parameters(), lr=LR)
    if rank == 2:
        grown = copy.deepcopy(stage)
        grown.register_parameter("bogus", nn.Parameter(torch.zeros(2)))
    try:
        checkpoint.load(os.path.join(root, "two"), model=grown if rank == 2 else stage)
    except CheckpointError as exc:
        out["missing"] = str(exc)
    out["extra"] = checkpoint.load(os.path.join(root, "two"), model=stage, optimizer=adam)
    out["loaded"] = clone(stage.state_dict())
    out["optimizer"] = optimizer_state(stage, adam)
    out["lr"] = adam.param_groups[0]["lr"]
    full = original(seed=9)
    full.load_state_dict(checkpoint.load_full_state_dict(os.path.join(root, "two")))
    step(full, [(stage, adam)])
    out["stepped"] = clone(stage.state_dict())
    checkpoint.save(os.path.join(root, "three"), model=stage, optimizer=adam, extra={"rank": rank})
    again = stage_module(original(seed=8), LOAD_SPLIT[rank])
    again_adam = torch.optim.Adam(again.parameters(), lr=LR)
    out["own_extra"] = checkpoint.load(
        os.path.join(root, "three"), model=again, optimizer=again_adam
    )
    out["reloaded"] = clone(again.state_dict())
    return out


def test_save_on_two_ranks_reshards_onto_three(tmp_path: Path) -> None:
    root = str(tmp_path)
    saved = run_ranks(_save_two, 2, root, timeout_s=60)
    states, optimizer_states = reference()
    assert sorted(set(saved[0]["names"]) | set(saved[1]["names"])) == sorted(states[0])
    shared = {"shared.weight", "tail.weight", "tail.bias"}  # tied, and replicated
    assert set(saved[0]["names"]) & set(saved[1]["names"]) == shared
    for error in (saved[0]["error"], saved[1]["error"]):
        assert error and "model/shared.weight differs between rank 0 and ranks [1]" in error
    assert not os.path.exists(os.path.join(root, "bad", ".metadata"))

    # written once although both ranks hold it (DCP deduplicates), and whole
    storage = FileSystemReader(os.path.join(root, "two")).read_metadata().storage_data
    for key in ("model/shared.weight", "model/tail.weight", "optim/tail.weight/tensor/exp_avg"):
        assert sum(index.fqn == key for index in storage) == 1, key
    two = checkpoint.load_full_state_dict(os.path.join(root, "two"))
    assert sorted(two) == sorted(states[2])
    assert_same(two, states[2])
    fresh = original(seed=3)
    fresh.load_state_dict(two, strict=True)
    assert_same(fresh.state_dict(), states[2])

    ranks = run_ranks(_load_three, 3, root, timeout_s=60)
    assert [sorted(r["loaded"]) for r in ranks] == [
        ["net.0.bias", "net.0.weight", "shared.weight"],
        ["net.3.bias", "net.3.weight", "net.6.bias", "net.6.weight"],
        ["net.9.bias", "net.9.weight", "tail.bias", "tail.weight"],
    ]
    assert "no 'bogus', which rank 2's module holds" in ranks[0]["missing"]
    assert all(r["missing"] == ranks[0]["missing"] for r in ranks)
    for r, out in enumerate(ranks):
        assert out["extra"]["rank"] == 0 and out["extra"]["step"] == 2, r  # world size changed
        assert out["own_extra"] == {"rank": r}
        assert out["lr"] == LR / 2
        assert_same(out["loaded"], states[2])
        assert_same(out["stepped"], states[3])
        assert_same(out["reloaded"], states[3])
        assert sorted(out["optimizer"]) == sorted(out["loaded"]), r  # every parameter's state
        for name, state in out["optimizer"].items():
            assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"], name
            assert_same(state, optimizer_states[2][name])
    three = checkpoint.load_full_state_dict(os.path.join(root, "three"))
    assert sorted(three) == sorted(states[3])
    assert_same(three, states[3])


def test_a_schedulers_nested_state_round_trips_through_entries() -> None:
    """SequentialLR holds its schedulers' states in a list of dicts; every number comes back
    with its type, configuration (strings, None) is left out."""
    from pdcompile.runtime.checkpoint_entries import restore_state, state_entries

    def make() -> torch.optim.lr_scheduler.LRScheduler:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        parts = [torch.optim.lr_scheduler.ConstantLR(opt, 0.5, 2),
                 torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, 1, 2)]  # fmt: skip
        return torch.optim.lr_scheduler.SequentialLR(opt, parts, milestones=[2])

    trained = make()
    for _ in range(6):
        trained.optimizer.step()
        trained.step()
    entries = state_entries(trained.state_dict(), "scheduler")
    assert all(isinstance(v, bool | int | float | torch.Tensor) for v in entries.values())
    assert entries["scheduler/_schedulers/1/T_i"] == 4 and "scheduler/_milestones" in entries
    fresh = make()
    assert fresh.state_dict() != trained.state_dict()
    fresh.load_state_dict(restore_state(fresh.state_dict(), entries, "scheduler"))
    assert fresh.state_dict() == trained.state_dict()
    assert state_entries({"mode": "min", "fn": None, "lrs": []}, "s") == {}
