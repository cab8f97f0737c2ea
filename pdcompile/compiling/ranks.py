"""How the ranks of a `compile` call meet and agree: joining the process group, the start-up
collectives under a deadline, the fingerprint check, the plan's broadcast, and the agreement
after each later phase (a rank that fails raises its own error and every other rank one of its
class naming that rank and its message)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from pdcompile.core import errors
from pdcompile.core.errors import PdcompileError, PipelineTimeoutError
from pdcompile.passes.planning.plans import Plan

AFTER_TIMEOUT_S = 2.0  # how long a rank that timed out waits to agree on a phase
Phase = Callable[..., contextlib.AbstractContextManager[None]]


@dataclass(frozen=True)
class Job:
    """This process's place: its rank among `world_size`, its device, and whether it is one
    rank of a torch.distributed job (else it runs every rank of the plan)."""

    rank: int
    world_size: int
    device: torch.device
    distributed: bool

    def phase(self, timeout_s: float) -> Phase:
        """`agreement` for this job: `phase(what, timeout_s=...)` runs a phase on every rank,
        then the ranks agree on how it ended."""
        return functools.partial(agreement, self, timeout_s=timeout_s)


def join(model: nn.Module, timeout_s: float) -> Job:
    """Join the process group (one already initialised, or torchrun's variables, within
    `timeout_s`), or none: then this process is the whole job, on the model's device."""
    from pdcompile.runtime.distributed import init_process_group

    device = _local_device(model)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":  # NCCL moves CUDA tensors only
            device = torch.device("cuda", torch.cuda.current_device())
        return Job(dist.get_rank(), dist.get_world_size(), device, True)
    if not {"RANK", "WORLD_SIZE"} <= set(os.environ):
        return Job(0, 1, device, False)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return Job(rank, world_size, init_process_group(rank, world_size, timeout_s=timeout_s), True)


def _local_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    if param is None or param.device.type == "meta":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return param.device


def collective(
    rank: int, what: str, run: Callable[[], Any], timeout_s: float, tag: str | None = None
) -> Any:
    """Run a start-up collective for at most `timeout_s` and return what it returns; a timeout
    or a dead rank becomes `PipelineTimeoutError` naming the ranks that never arrived, or the
    rank holding a store that stopped answering ("another rank" when none can be told:
    `runtime.bounded.collective`)."""
    from pdcompile.runtime.bounded import collective as bounded

    return bounded(rank, what, run, timeout_s, tag, "did not call pdcompile.compile")


def fingerprint(gm: torch.fx.GraphModule, options: dict[str, Any]) -> str:
    """A digest of what every rank must agree on: the graph's code, its tensors' names, shapes
    and dtypes, and the options."""
    digest = hashlib.sha256(gm.code.encode())
    for name, tensor in [*gm.named_parameters(), *gm.named_buffers()]:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    digest.update(repr(sorted(options.items())).encode())
    return digest.hexdigest()


def check_fingerprints(
    mine: str | Exception,
    job: Job,
    timeout_s: float,
    capture: tuple[torch.fx.GraphModule, dict[str, Any]] | None = None,
) -> None:
    """Compare every rank's fingerprint with rank 0's; `mine` is this rank's error if it could
    not capture the model: then every rank stops (this one with its own error). When they
    differ, the ranks exchange summaries of their `capture` (graph and options) and the error
    names the first difference (`capture/graph_diff.py`)."""
    everyone: list[str | None] = [None] * job.world_size
    sent = mine if isinstance(mine, str) else f"error: {type(mine).__name__}: {mine}"
    collective(job.rank, "comparing graph fingerprints",
               lambda: dist.all_gather_object(everyone, sent), timeout_s)  # fmt: skip
    if isinstance(mine, Exception):
        raise mine
    failed = [(r, text) for r, text in enumerate(everyone) if text.startswith("error: ")]
    if failed:
        r, text = failed[0]
        raise PdcompileError(
            f"rank {r} could not capture the model or read its plan, so no rank can start: "
            f"{text.removeprefix('error: ')}"
        )
    differ = [r for r, other in enumerate(everyone) if other != everyone[0]]
    if differ:
        raise PdcompileError(
            f"ranks {differ} captured another model or call than rank 0"
            + (" (this is one of them)" if job.rank in differ else "")
            + (
                _first_difference(differ[0], job, timeout_s, capture)
                or ": every rank must call pdcompile.compile with the same model, example "
                "inputs, options and plan"
            )
        )


def _first_difference(
    other: int,
    job: Job,
    timeout_s: float,
    capture: tuple[torch.fx.GraphModule, dict[str, Any]] | None,
) -> str:
    """What rank `other`'s capture (graph and options) first differs in from rank 0's, after
    ": ", from summaries every rank exchanges; "" when either has none."""
    from pdcompile.capture.graph_diff import describe, first_difference

    summaries: list[Any] = [None] * job.world_size
    summary = describe(*capture) if capture is not None else None
    collective(job.rank, "comparing graphs",
               lambda: dist.all_gather_object(summaries, summary), timeout_s)  # fmt: skip
    if summaries[0] is None or summaries[other] is None:
        return ""
    return ": " + first_difference(other, summaries[other], summaries[0])


def share_plan(plan: Plan | None, failure: Exception | None, rank: int, timeout_s: float) -> str:
    """Rank 0's plan on every rank, as JSON (read in an agreed phase: `Plan.from_json` checks
    it), within `timeout_s`; rank 0's planning error stops every rank."""
    mine = plan.to_json() if plan is not None else None  # rank 0 has one, the others None
    shared = [("error", f"{type(failure).__name__}: {failure}") if failure else mine]
    what = "sending the plan to the other ranks" if rank == 0 else "receiving the plan from rank 0"
    collective(rank, what, lambda: dist.broadcast_object_list(shared, src=0), timeout_s,
               "the plan")  # fmt: skip
    if failure is not None:
        raise failure
    if isinstance(shared[0], tuple):
        raise PdcompileError(f"rank 0 could not plan, so no rank can start: {shared[0][1]}")
    return shared[0]


@contextlib.contextmanager
def agreement(job: Job, what: str, timeout_s: float = 900.0) -> Iterator[None]:
    """Run a phase of `compile` on every rank, then agree on how it ended (one
    `all_gather_object` within `timeout_s`, also after a failure: so a phase must not start a
    collective after a point where it can fail on one rank only; after a `PipelineTimeoutError`,
    a rank at fault is gone: the others wait `AFTER_TIMEOUT_S` only, to hear of another
    failure). In one process just the phase.

    Raises:
        PdcompileError: on every other rank when a rank failed the phase: of the failure's
            class if that is a pdcompile error, naming the first failed rank and its message;
            the failed rank raises its own error.
        PipelineTimeoutError: a rank died or hangs (`collective`).
    """
    if not job.distributed or job.world_size == 1:
        yield
        return
    failure: Exception | None = None
    try:
        yield
    except Exception as exc:
        failure = exc
    everyone: list[str | None] = [None] * job.world_size
    sent = None if failure is None else f"{type(failure).__name__}: {failure}"
    if isinstance(failure, PipelineTimeoutError):
        timeout_s = min(timeout_s, AFTER_TIMEOUT_S)
    try:
        collective(job.rank, f"agreeing on {what}",
                   lambda: dist.all_gather_object(everyone, sent), timeout_s)  # fmt: skip
    except PipelineTimeoutError:
        if failure is None:
            raise
        # a peer died too: this rank's own error says more than the closed connection
    if failure is not None:
        raise failure
    failed = [(r, text) for r, text in enumerate(everyone) if text is not None]
    if failed:
        first, text = failed[0]
        also = f" (ranks {[r for r, _ in failed[1:]]} failed too)" if len(failed) > 1 else ""
        raise relayed(
            text,
            f"rank {first} failed {what}{also}, so rank {job.rank} stops too: {text}; the fix "
            f"is in rank {first}'s error",
        )


def relayed(text: str, message: str) -> PdcompileError:
    """`message` as an error of the class `text` ("ClassName: ...") names, if that is a
    pdcompile error (so `except PartitionError` works on every rank), else `PdcompileError`."""
    kind = getattr(errors, text.split(":", 1)[0], None)
    if isinstance(kind, type) and issubclass(kind, PdcompileError):
        return kind(message)
    return PdcompileError(message)
