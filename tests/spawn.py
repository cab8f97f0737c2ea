"""Run a function on several ranks in spawned processes, with a hard timeout.

`run_ranks(fn, world_size, *args)` starts one process per rank (start method "spawn", one thread
each); each calls `fn(rank, world_size, init_file, *args)`, where `init_file` is a fresh path for
a `FileStore` rendezvous. `fn` must be a module-level function: the child imports its module (by
name, or else from its file) with the tests directory on `sys.path`. Results travel back pickled,
so they must be picklable (tensors are). `free_port()` is a port for a TCP rendezvous.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import os
import pickle
import queue
import random
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

_PORTS = itertools.count(random.randrange(10_000, 30_000, 97))  # below the ephemeral range
_PORTS_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback port free now that this process never handed out before.

    The kernel hands ports of its ephemeral range (32768-60999 on Linux) to every outgoing
    connection and every `bind(0)`, gloo's among them: a port found free there may be taken by
    a concurrent job's socket before rank 0 listens on it. Below that range only an explicit bind
    takes a port.
    """
    with _PORTS_LOCK:
        while True:
            port = next(_PORTS)
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port


@dataclass
class RankOutcome:
    """How one rank ended: `value` when `error` is None, else the exception's type name."""

    rank: int
    value: Any = None
    error: str | None = None
    message: str = ""
    traceback: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


class RankFailed(AssertionError):
    """A rank raised, exited without reporting, or the ranks ran past the timeout."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 90,
    allow_failures: bool = False,
    wait_for: Sequence[int] | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, init_file, *args)` on `world_size` spawned ranks.

    Returns:
        the values the ranks returned, by rank; with `allow_failures`, a `RankOutcome` per rank
        (a rank that exited without reporting has error "exit" and its exit code as message).
        With `wait_for`, only those ranks are awaited: the others are killed once they have
        reported, those that had not with error "unfinished" (a rank stopped by a test).

    Raises:
        RankFailed: a rank failed (unless `allow_failures`: then the others run to their end) or
            the ranks ran past `timeout_s`; every child is killed first.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    target = (fn.__module__, fn.__qualname__, inspect.getfile(fn))
    with tempfile.TemporaryDirectory(prefix="pdcompile-ranks-") as tmp:
        init_file = os.path.join(tmp, "store")
        processes = [
            ctx.Process(
                target=_child,
                args=(target, rank, world_size, init_file, args, results),
                name=f"rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        try:
            awaited = set(range(world_size) if wait_for is None else wait_for)
            outcomes = _collect(processes, results, timeout_s, allow_failures, awaited)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join(timeout=10)
    for rank in range(world_size):
        outcomes.setdefault(rank, RankOutcome(rank, error="unfinished", message="killed"))
    if allow_failures:
        return [outcomes[rank] for rank in range(world_size)]
    return [outcomes[rank].value for rank in range(world_size)]


def _collect(
    processes: list[Any], results: Any, timeout_s: float, allow_failures: bool, awaited: set[int]
) -> dict[int, RankOutcome]:
    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout_s
    while not awaited <= set(outcomes):
        try:
            outcome = pickle.loads(results.get(timeout=0.2))
            outcomes[outcome.rank] = outcome
            if not outcome.ok and not allow_failures:
                raise RankFailed(_describe(outcome))
            continue
        except queue.Empty:
            pass
        silent = [r for r, p in enumerate(processes) if r not in outcomes and not p.is_alive()]
        if silent and results.empty():
            time.sleep(0.5)  # a result may still be on its way through the pipe
            if not results.empty():
                continue
            for rank in silent:
                code = processes[rank].exitcode
                outcomes[rank] = RankOutcome(rank, error="exit", message=f"exit code {code}")
                if not allow_failures:
                    raise RankFailed(f"rank {rank} exited with code {code} without a result")
        if time.monotonic() > deadline:
            missing = sorted(awaited - set(outcomes))
            raise RankFailed(
                f"ranks {missing} did not finish within {timeout_s:g} s (killed); finished: "
                + "; ".join(_describe(o) for o in outcomes.values())
            )
    return outcomes


def _describe(outcome: RankOutcome) -> str:
    if outcome.ok:
        return f"rank {outcome.rank}: ok"
    return f"rank {outcome.rank} raised {outcome.error}: {outcome.message}\n{outcome.traceback}"


def _child(
    target: tuple[str, str, str],
    rank: int,
    world_size: int,
    init_file: str,
    args: tuple,
    results: Any,
) -> None:
    """The entry point of a rank: resolve `fn`, run it, report how it ended."""
    import torch

    torch.set_num_threads(1)
    if TESTS_DIR not in sys.path:
        sys.path.insert(0, TESTS_DIR)
    try:
        fn = _resolve(*target)
        outcome = RankOutcome(rank, value=fn(rank, world_size, init_file, *args))
    except BaseException as exc:  # every failure goes back to the parent
        outcome = RankOutcome(rank, None, type(exc).__name__, str(exc), traceback.format_exc())
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:  # an unpicklable result
        data = pickle.dumps(RankOutcome(rank, None, type(exc).__name__, f"result: {exc}"))
    results.put(data)
    results.close()
    results.join_thread()


def _resolve(module_name: str, qualname: str, path: str) -> Callable[..., Any]:
    """The function, importing its module by name or else from its file (importlib test mode)."""
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            spec = importlib.util.spec_from_file_location(module_name, path)
            assert spec is not None and spec.loader is not None, path
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
