"""Waits outside the step machinery are bounded and name the rank at fault (issue 31,
runtime/bounded.py): a collective that does not end within its timeout, a store that stops
answering (it lives in a stopped rank 0's process without torchrun), the loaded profile's signal,
and a loading rank that waited `startup_timeout` for rank 0's profile, then as long again for the
plan. The `faults` tier (tests/test_faults.py) stops and kills real ranks at every point."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawn import run_ranks

import pdcompile
from pdcompile import zoo
from pdcompile.core.errors import PipelineTimeoutError
from pdcompile.runtime import bounded
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.profile_load import ProfileLoad

pytestmark = pytest.mark.timeout(120)  # the old waits never ended


@pytest.fixture
def one_rank(tmp_path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """A gloo group of one rank; `dist.get_world_size` says 3, so ranks 1 and 2 never arrive."""
    init_process_group(0, 1, init_file=str(tmp_path / "store"), backend="gloo", timeout_s=30)
    monkeypatch.setattr(dist, "get_world_size", lambda *args: 3)
    yield
    monkeypatch.undo()
    dist.destroy_process_group()


def test_a_collective_past_its_timeout_names_the_ranks_that_never_arrived(one_rank) -> None:
    start = time.monotonic()
    with pytest.raises(PipelineTimeoutError) as caught:
        bounded.collective(0, "waiting for nothing", threading.Event().wait, 0.5,
                           culprit="did not call it")  # fmt: skip
    assert time.monotonic() - start < 5
    assert str(caught.value).startswith(
        "rank 0 gave up waiting for nothing after waiting 0.5 s (timeout 0.5 s): ranks [1, 2] "
        "never arrived (died, hangs, or did not call it)"
    ), caught.value


class _Unanswering:
    """A store whose every call blocks: a `TCPStore` held by a stopped rank 0."""

    def check(self, keys: list[str]) -> bool:
        threading.Event().wait()
        return False

    def set(self, key: str, value: str) -> None:
        threading.Event().wait()


def test_a_store_that_stops_answering_ends_the_load_and_names_its_rank(
    one_rank, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed import distributed_c10d

    monkeypatch.setattr(distributed_c10d, "_get_default_store", lambda: _Unanswering())
    monkeypatch.setattr(bounded, "store_host", lambda: 0)
    load = ProfileLoad(1, 3, active=False)
    load.loaders, load._key = [1], "pdcompile/profiled/x"
    start = time.monotonic()
    assert load.serve(lambda: time.sleep(0.01), timeout_s=0.5) is False
    assert time.monotonic() - start < 5  # the old loop blocked in store.check
    with pytest.raises(PipelineTimeoutError, match=r"rank 0 hangs \(its process holds"):
        bounded.collective(1, "receiving the plan", lambda: None, 0.5)


STARTUP_S = 6.0


def _rank_0_hangs_while_profiling(rank: int, world_size: int, init_file: str) -> tuple:
    """Rank 0 hangs in its profile; rank 1 (which loads it) reports its error and the seconds
    from entering the load to the error."""
    import pdcompile.compiling.analysis as analysis

    init_process_group(rank, world_size, init_file=init_file, timeout_s=STARTUP_S)
    torch.manual_seed(0)
    model, x = zoo.MLP(p=0.0).train(), torch.randn(12, 32)
    if rank == 0:
        analysis.analyze = lambda *args, **kwargs: time.sleep(10 * STARTUP_S)
    entered = []
    serve = ProfileLoad.serve
    ProfileLoad.serve = lambda *args: entered.append(time.monotonic()) or serve(*args)
    try:
        pdcompile.compile(model, (x,), loss_fn=F.cross_entropy, cluster=2,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          startup_timeout=STARTUP_S)  # fmt: skip
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - entered[0]
    return "none", "", 0.0


@pytest.mark.faults  # waits out a stopped or dead rank's timeout: the faults tier
def test_a_loading_rank_waits_for_a_hanging_rank_0_once_and_names_it() -> None:
    """It waited `startup_timeout` in the load, then as long again for the plan (30 s measured
    for startup_timeout=15 under torchrun)."""
    os.environ.pop("PDCOMPILE_CACHE_DIR", None)
    (_, rank1) = run_ranks(_rank_0_hangs_while_profiling, 2, timeout_s=150, allow_failures=True,
                           wait_for=[1])  # fmt: skip
    error, message, seconds = rank1.value
    assert error == "PipelineTimeoutError", message
    assert message.startswith("rank 1 gave up receiving the plan from rank 0"), message
    assert "rank 0 never arrived" in message, message
    assert STARTUP_S <= seconds < 1.6 * STARTUP_S, (seconds, message)
