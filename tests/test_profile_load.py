"""compile()'s profile in the run's conditions (runtime/profile_load.py): while rank 0 profiles,
the other ranks on its machine train the model on the example, leaving it as it was, and stop
when rank 0 is done, failed or not; the profile cache keeps loaded and lone profiles apart."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from spawn import run_ranks

import pdcompile
from pdcompile.passes.profile_cache import ProfileSettings, cache_key
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.profile_load import ProfileLoad, example_step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.ReLU(),
                         nn.Linear(16, 4)).train()  # fmt: skip


def test_the_load_changes_nothing_of_the_model() -> None:
    model, x, y = _model(), torch.randn(6, 8), torch.randint(0, 4, (6,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    step = example_step(model, (x,), None, F.cross_entropy, y)
    step()
    step()
    example_step(model, (x,), None, None, None)()  # no loss: the outputs' mean
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BN's too
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)  # dropout's masks in the run stay the same


def _ranks(rank: int, world_size: int, init_file: str, cache: str) -> dict:
    torch.set_num_threads(1)
    os.environ["PDCOMPILE_CACHE_DIR"] = cache
    init_process_group(rank, world_size, init_file=init_file, backend="gloo", timeout_s=60)
    out: dict = {}
    calls = [0]

    def step() -> None:
        calls[0] += 1
        time.sleep(0.01)

    for failing in (False, True):
        load = ProfileLoad(rank, world_size)
        if rank == 0:
            try:
                with load.profiling() as loaded_by:
                    out["loaded_by"] = loaded_by
                    time.sleep(0.3)
                    if failing:
                        raise ValueError("rank 0's profile failed")
            except ValueError:
                out["raised"] = True
        else:
            signalled = load.serve(step, timeout_s=50)
            out[f"served {failing}"] = (calls[0], signalled)
        dist.barrier()
    model, x, y = _model(), torch.randn(16, 8), torch.randint(0, 4, (16,))
    pipe = pdcompile.compile(model, (x[:4],), example_targets=y[:4], loss_fn=F.cross_entropy,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                             num_microbatches=4, schedule="1f1b", solver="blocks",
                             cluster="2", startup_timeout=60)  # fmt: skip
    out["loss"] = pipe.train_step(x, y)
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_other_ranks_train_while_rank_0_profiles(tmp_path: Path) -> None:
    zero, one = run_ranks(_ranks, 2, str(tmp_path), timeout_s=120)
    assert zero["loaded_by"] == 1 and zero["raised"]
    # rank 1 trained during rank 0's 0.3 s, and rank 0's signal (not the timeout) stopped it,
    # also when rank 0's profile raised
    before, signalled = one["served False"]
    assert before >= 1 and signalled
    after, signalled = one["served True"]
    assert after > before and signalled
    profiles = [json.loads(p.read_text()) for p in tmp_path.glob("profile-*.json")]
    # compile's, at every row count: taken loaded
    assert profiles and {p["settings"]["loaded_by"] for p in profiles} == {1}
    optimizer = list(tmp_path.glob("optimizer-*.json"))
    assert len(optimizer) == 1
    assert zero["loss"] == one["loss"] and math.isfinite(zero["loss"])  # the plan trains


def test_a_loaded_profile_has_a_cache_key_of_its_own() -> None:
    gm = pdcompile.trace(_model().eval(), (torch.randn(4, 8),))
    inputs = {"input": torch.randn(4, 8)}
    alone = ProfileSettings("cpu", 1, 3, 10, torch.__version__)
    loaded = ProfileSettings("cpu", 1, 3, 10, torch.__version__, loaded_by=1)
    assert cache_key(gm, inputs, alone) != cache_key(gm, inputs, loaded)
    assert "while 1 other ranks trained" in loaded.origin()
