"""`PipelinedModule.close()` releases the process groups a distributed pipeline made: a process
that compiles again and again keeps its threads and file descriptors, and a closed pipeline
refuses to train with a clear error. A pipeline collected unclosed releases them too, and warns
once (ResourceWarning)."""

from __future__ import annotations

import gc
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from spawn import run_ranks

import pdcompile
from pdcompile.core.errors import StageCommError
from pdcompile.runtime.distributed import init_process_group


def _held() -> tuple[int, int]:
    """(threads, gloo's included, and open file descriptors) of this process."""
    return tuple(len(os.listdir(f"/proc/{os.getpid()}/{what}")) for what in ("task", "fd"))


def _ranks(rank: int, world_size: int, init_file: str) -> dict:
    torch.set_num_threads(1)
    init_process_group(rank, world_size, init_file=init_file, backend="gloo", timeout_s=60)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    held = []
    for _ in range(4):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
        options = dict(loss_fn=F.cross_entropy, profile=False, cluster="2", solver="blocks",
                       optimizer=sgd, num_microbatches=4)  # fmt: skip
        with pdcompile.compile(model, (x[:2],), schedule="1f1b", **options) as pipe:
            pipe.train_step(x, y)
        held.append(_held())
    out = {"held": held}
    try:
        pipe.train_step(x, y)
    except StageCommError as exc:
        out["closed"] = str(exc)
    del pipe
    out["unclosed"] = _unclosed(x, y)
    dist.barrier()
    dist.destroy_process_group()
    return out


def _unclosed(x: torch.Tensor, y: torch.Tensor) -> dict:
    """A loop of compiles never closed, each dropped with `del` and `gc.collect()` (streaming,
    measured and plain pipelines): what the process holds after each, the warnings."""
    held = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
            sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
            pipe = pdcompile.compile(
                model, (x[:2],), schedule=["1f1b", "pipedream", "gpipe"][i % 3],
                loss_fn=F.cross_entropy, profile=False, cluster="2", solver="blocks",
                optimizer=sgd, num_microbatches=4,
            )  # fmt: skip
            pipe.measure_memory(i % 2 == 0)
            pipe.train_step(x, y)
            del pipe
            gc.collect()
            dist.barrier()  # both ranks released theirs
            held.append(_held())
    warned = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    return {"held": held, "warned": warned}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """One spawned group for both tests."""
    return run_ranks(_ranks, 2, timeout_s=180)


def test_closing_releases_the_groups_and_a_closed_pipeline_refuses_to_train(ranks) -> None:
    for out in ranks:
        (threads, fds), *later = out["held"]
        # nothing accumulates (unclosed, each pipeline kept 14 threads and 20 descriptors);
        # the threads of the groups just destroyed may still be on their way out
        assert all(t <= threads + 4 and f == fds for t, f in later), out["held"]
        assert "after the pipeline was closed; compile the model again" in out["closed"]


def test_a_pipeline_collected_unclosed_releases_its_groups_and_warns_once(ranks) -> None:
    for out in ranks:
        (threads, fds), *later = out["unclosed"]["held"]
        # unclosed, each compile kept 14 threads and 20 descriptors until the process ended
        assert all(t <= threads + 4 and f <= fds + 2 for t, f in later), out["unclosed"]
        (warned,) = out["unclosed"]["warned"]
        assert "garbage-collected without close()" in warned and "with pdcompile" in warned
