"""Checkpoints of a pipelined run: each rank saves and loads its stage by name, with DCP.

A rank's stage module holds parameters and buffers under the original model's names, so a
checkpoint is one flat, name-keyed dictionary of tensors written by `torch.distributed.checkpoint`
(DCP). Any plan or world size loads it (each rank reads the names it holds: resharding), and one
process reads the whole model back (`load_full_state_dict`). Keys (see docs/checkpoints.md):

    pdcompile/format            int64 [format version, saving world size]
    model/<name>                the stage modules' state dicts, tied aliases under every name
    optim/<name>/tensor/<key>   the parameter's optimizer state (exp_avg, momentum_buffer, step)
    optim/<name>/scalar/<key>   ... a Python number in that state, as a 0-d tensor
    optim/<name>/hyper/<key>    its param group's numeric hyperparameters (lr, betas, ...)
    extra/<rank>/tensor/<key>   each rank's `extra`: tensors,
    extra/<rank>/scalar/<key>   ... and Python numbers

A key held by several ranks (replicas, tied copies) is written once: DCP deduplicates a key saved
by several ranks (one of them writes it, balancing bytes per rank); `save` first checks the copies
agree.

Saves are atomic and loads verified (`runtime/manifest.py`): a save writes a staging folder, rank 0
adds `manifest.json` with every file's SHA-256 and renames it into place; a load checks the
manifest and the checksums before DCP opens anything (its `.metadata` is a pickle).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pdcompile.core.errors import CheckpointError, PdcompileError
from pdcompile.runtime import manifest
from pdcompile.runtime.checkpoint_disk import disk_full
from pdcompile.runtime.checkpoint_entries import (
    empty,
    encode,
    optimizer_items,
    optimizer_reads,
    restore_optimizer,
)
from pdcompile.runtime.checkpoint_ranks import Ranks, ranks_of
from pdcompile.runtime.checkpoint_reader import Reader, read_metadata

__all__ = ["load", "load_full_state_dict", "rng_state", "save", "set_rng_state"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_FORMAT = "pdcompile/format"
PathLike = str | os.PathLike


def save(
    directory: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: Mapping[str, Any],
    step: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    timeout_s: float | None = None,
) -> None:
    """Write this rank's stage (module, optimizer, `extra`) into the checkpoint `directory`.

    Every rank calls it: a collective when a process group is initialised, else a local save.
    Atomic: the checkpoint is written beside `directory` and renamed into place once complete,
    so a process killed mid-save leaves the previous checkpoint (docs/checkpoints.md).

    Args:
        directory: a folder every rank sees (created if needed; a checkpoint there is replaced
            whole; a folder holding other files is refused).
        model: this rank's stage module, under the original model's names.
        optimizer: its optimizer (state saved by parameter name), or None.
        extra: this rank's small metadata, kept per rank: tensors or Python bool, int, float
            values, e.g. `{"step": 100, **rng_state()}`.
        step: the step count recorded in `manifest.json` (rank 0's), or None.
        process_group: the ranks that save (default: every rank); its own timeout bounds
            their waits for each other.
        timeout_s: with the default group, how long a wait for the other ranks may last
            (`PipelinedModule.save` passes `compile(timeout=...)`); None: the group's timeout.

    Raises:
        CheckpointError: on every rank, when a value in `extra` or the optimizer state is not a
            tensor or a number, when ranks hold a name with different shapes or values, when
            `directory` holds files that are not a checkpoint's, or when the write fails.
        PipelineTimeoutError: a rank died or hung past the timeout; the checkpoint in
            `directory` is then whole, the previous one unless the error says otherwise.
    """
    path = os.path.abspath(os.fspath(directory))
    with ranks_of(path, "saving", process_group, timeout_s) as ranks:
        rank, world_size = ranks.rank, ranks.world_size
        items: dict[str, torch.Tensor] = {_FORMAT: torch.tensor([FORMAT_VERSION, world_size])}
        items.update({f"model/{k}": v for k, v in model.state_dict(keep_vars=False).items()})
        problems = [] if optimizer is None else optimizer_items(model, optimizer, items)
        for key, value in extra.items():
            problems += encode(f"extra/{rank}/", str(key), value, items, f"extra[{key!r}]")
        token, prepared = uuid.uuid4().hex[:8], []
        if rank == 0:
            prepared = _attempt(lambda: manifest.prepare(path, token), "preparing")
        committed = False
        try:
            keys, token = _agree(items, problems + prepared, ranks, token)
            staging = manifest.staging_path(path, token)
            with ranks.phase("writing its files"), _dcp(path, rank, not ranks.local, True):
                saved = dcp.save(items, checkpoint_id=staging, process_group=ranks.group,
                                 no_dist=ranks.local)  # fmt: skip
            # DCP's save returns once rank 0 wrote `.metadata`, after every rank reported its
            # files written: the ranks hash them (on a shared filesystem), round robin, and
            # rank 0 commits
            names = sorted({".metadata", *(s.relative_path for s in saved.storage_data.values())})
            share, mine = names[rank::world_size], {}
            problems = _attempt(lambda: mine.update(manifest.hashes(staging, share)), "hashing")
            shares = ranks.gather((problems, mine), "hashing its files")
            problems = [] if rank else _commit(path, staging, token, keys, shares, world_size, step)
            committed = not problems
            whole = f"{path} holds the previous or the new checkpoint, whole (see its step)"
            _agree({}, problems, ranks, what="waiting for rank 0 to commit it", outcome=whole)
        except Exception as exc:
            full = isinstance(exc, CheckpointError) and disk_full(path, exc, _bytes(items))
            if rank == 0 and not prepared:  # what this save left goes; a refused one left none
                (manifest.finish if committed else manifest.abandon)(path, token)
            if full:
                raise CheckpointError(f"checkpoint {path}: {full} ({exc})") from exc
            raise
    if rank == 0:
        manifest.finish(path, token)  # the previous checkpoint deleted: no rank waits for it
    log.info("rank %d: saved %d entries to %s", rank, len(items), path)


def load(
    directory: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    process_group: dist.ProcessGroup | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Load, in place, the names this rank's module holds from a checkpoint saved by any plan.

    Every rank calls it (a collective when a process group is initialised). Parameters and
    buffers are copied in (converted to the module's dtypes); the optimizer gets the state and
    numeric hyperparameters (lr, betas, ...) saved under its parameters' names.

    Args:
        directory: a folder written by `save`, under any plan or world size.
        model: this rank's stage module, under the original model's names (not on `meta`).
        optimizer: its optimizer, built over the module's parameters, or None.
        process_group, timeout_s: as for `save`.

    Returns:
        the `extra` this rank saved when as many ranks saved as load; otherwise (the world size
        changed) saved rank 0's `extra` on every rank, with a warning logged: its step count
        holds, its RNG states are rank 0's.

    Raises:
        CheckpointError: on every rank, when `directory` is not a pdcompile checkpoint, is
            partial or altered (a file missing, added, not a regular file or unlike its
            checksum in the manifest: checked before any file is opened), or lacks a name (or
            its optimizer state) that some rank holds, or has it in another shape.
        PipelineTimeoutError: a rank died or hung past the timeout (the module may be partly
            loaded if the error says so).
    """
    path, problems, reads, chosen = os.fspath(directory), [], {}, []
    with ranks_of(path, "loading", process_group, timeout_s) as ranks:
        rank, world_size = ranks.rank, ranks.world_size
        _verify(path, ranks)
        try:
            metadata, saved_world_size = _open(path)
        except CheckpointError as exc:  # raised below, on every rank at once
            metadata, saved_world_size = None, world_size
            problems.append(str(exc).removeprefix(f"checkpoint {path}: "))
        source = rank if saved_world_size == world_size else 0
        module_state = model.state_dict(keep_vars=False)
        if metadata is not None:
            problems += _module_reads(path, rank, metadata, module_state, reads)
            if optimizer is not None:
                chosen = optimizer_reads(model, optimizer, metadata, reads, problems)
            keys = [k for k in metadata.state_dict_metadata if k.startswith(f"extra/{source}/")]
            reads.update({k: empty(metadata, k) for k in keys})
        _agree({}, problems, ranks, what="agreeing on what to load")
        with ranks.phase("reading its files", "this rank's module may be partly loaded"):
            with _dcp(path, rank, not ranks.local):
                dcp.load(reads, storage_reader=Reader(path), process_group=ranks.group,
                         no_dist=ranks.local)  # fmt: skip
    model.load_state_dict(module_state, strict=True)  # the modules' own load hooks run
    if optimizer is not None:
        restore_optimizer(optimizer, chosen, reads, path)
    if source != rank:
        log.warning(
            "rank %d: %s was saved by %d ranks: returning saved rank 0's extra",
            rank,
            path,
            saved_world_size,
        )
    extra = {}
    for key, value in reads.items():
        if key.startswith(f"extra/{source}/"):
            _, _, kind, name = key.split("/", 3)
            extra[name] = value if kind == "tensor" else value.item()
    return extra


def _module_reads(
    path: str, rank: int, metadata: Metadata, state: dict[str, torch.Tensor], reads: dict
) -> list[str]:
    """Add the module's entries to `reads`; the problems of names missing or unlike the saved."""
    problems = []
    entries = metadata.state_dict_metadata
    for name, tensor in state.items():
        entry = entries.get(f"model/{name}")
        if not isinstance(entry, TensorStorageMetadata):
            problems.append(
                f"no {name!r}, which rank {rank}'s module holds: the checkpoint is of another "
                f"model (compare its names: load_full_state_dict({path!r}).keys())"
            )
        elif entry.size != tensor.shape:
            problems.append(
                f"{name!r} is {list(entry.size)} in the checkpoint but {list(tensor.shape)} "
                f"in rank {rank}'s module: build the model with its saved configuration"
            )
        elif tensor.is_meta:
            problems.append(
                f"{name!r} is on the meta device in rank {rank}'s module: "
                "materialise it first (module.to_empty(device=...))"
            )
        reads[f"model/{name}"] = tensor
    return problems


def load_full_state_dict(directory: PathLike) -> dict[str, torch.Tensor]:
    """The original model's whole state dict (every name, tied aliases included), on the CPU.

    For plain PyTorch, in one process (no process group needed).

    Raises:
        CheckpointError: `directory` is not a pdcompile checkpoint, is partial or altered (see
            `load`), or cannot be read whole.

    Example:
        >>> model.load_state_dict(pdcompile.load_full_state_dict("ckpt/100"), strict=True)
        <All keys matched successfully>
    """
    path = os.fspath(directory)
    _verify(path)
    metadata, _ = _open(path)
    state = {k: empty(metadata, k) for k in metadata.state_dict_metadata if k.startswith("model/")}
    with _dcp(path, 0):
        dcp.load(state, storage_reader=Reader(path), no_dist=True)
    return {key.removeprefix("model/"): tensor for key, tensor in state.items()}


def rng_state() -> dict[str, torch.Tensor]:
    """This process's torch generator states as tensors for `extra`: `rng/cpu`, `rng/cuda/<i>`."""
    states = {"rng/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.update({f"rng/cuda/{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return states


def set_rng_state(states: Mapping[str, Any]) -> None:
    """Restore the generators from what `rng_state` returned; other keys are ignored."""
    if "rng/cpu" in states:
        torch.set_rng_state(states["rng/cpu"])
    cuda = sorted((int(k.rsplit("/", 1)[1]), v) for k, v in states.items() if "rng/cuda/" in k)
    if cuda:
        torch.cuda.set_rng_state_all([state for _, state in cuda])


def _agree(
    items: dict[str, torch.Tensor],
    problems: list[str],
    ranks: Ranks,
    token: str = "",
    what: str = "agreeing on what to save",
    outcome: str = "",
) -> tuple[set[str], str]:
    """Raise on every rank when any rank has a problem, or ranks hold a key with other values.

    Two gathers: every rank's problems and keys, then fingerprints of the keys several hold.
    Returns the keys any rank holds and rank 0's `token`.
    """
    if ranks.local:
        _raise(problems, ranks.path)
        return set(items), token
    held = {key: (tuple(t.shape), str(t.dtype)) for key, t in items.items()}
    gathered = ranks.gather((problems, held, token), what, outcome)
    _raise([f"rank {r}: {p}" for r, (own, _, _) in enumerate(gathered) for p in own], ranks.path)
    holders: dict[str, list[int]] = {}
    for rank, (_, keys, _) in enumerate(gathered):
        for key in keys:
            holders.setdefault(key, []).append(rank)
    shared = [key for key, owners in holders.items() if len(owners) > 1]
    mine = {k: repr((*held[k], *_fingerprint(items[k]))) for k in shared if k in items}
    prints = ranks.gather(mine, what, outcome) if shared else []  # repr: NaN matches NaN
    for key in shared:
        owners = holders[key]
        if differ := [r for r in owners if prints[r][key] != prints[owners[0]][key]]:
            problems.append(
                f"{key} differs between rank {owners[0]} and ranks {differ} (shape, dtype or "
                "values): replicas and tied copies must agree when saved (flush first)"
            )
    _raise(problems, ranks.path)
    return set(holders), gathered[0][2]


def _commit(
    path: str,
    staging: str,
    token: str,
    keys: set[str],
    shares: list[tuple[list[str], dict[str, tuple[int, str]]]],
    world_size: int,
    step: int | None,
) -> list[str]:
    """Rank 0: write the manifest of the ranks' hashes (and of any file they did not hash) and
    put the checkpoint in place; the problems (every rank raises them)."""
    if problems := [f"rank {r}: {p}" for r, (own, _) in enumerate(shares) for p in own]:
        return problems
    holds = {
        "model": tuple(sorted(k[len("model/") :] for k in keys if k.startswith("model/"))),
        "optimizer": any(k.startswith("optim/") for k in keys),
        "extra": tuple(sorted({k.split("/", 3)[3] for k in keys if k.startswith("extra/")})),
        "step": step,
    }

    def finish() -> None:
        files = {name: entry for _, share in shares for name, entry in share.items()}
        rest = [n for n in os.listdir(staging) if n not in files and n != manifest.MANIFEST]
        files.update(manifest.hashes(staging, rest))  # e.g. a rank's file with no entries
        manifest.write(staging, manifest.Manifest(files=files, world_size=world_size, **holds))
        manifest.commit(staging, path, token)

    return _attempt(finish, "committing")


def _attempt(step: Callable[[], list[str] | None], what: str) -> list[str]:
    """The problems `step` returns (None: none), or its filesystem failure as one."""
    try:
        return step() or []
    except (OSError, CheckpointError) as exc:  # the latter: a file that is not a regular one
        return [f"{what} failed: {type(exc).__name__}: {exc}; check the folder's permissions and "
                "free space"]  # fmt: skip


def _bytes(items: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in items.values())


def _fingerprint(tensor: torch.Tensor) -> list[float]:
    """The sum and a position-weighted sum in float64: equal for equal tensors."""
    x = tensor.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device)
    return torch.stack([x.sum(), (x * weights).sum()]).tolist()


def _verify(path: str, ranks: Ranks | None = None) -> None:
    """Check the manifest and this rank's share of the checksums; raise on every rank when any
    rank finds a problem."""
    rank, world_size = (ranks.rank, ranks.world_size) if ranks else (0, 1)
    try:
        problems = [
            f"reading failed: rank {rank}: {problem}"
            for problem in manifest.verify(path, manifest.read(path), rank, world_size)
        ]
    except CheckpointError as exc:
        problems = [str(exc).removeprefix(f"checkpoint {path}: ")]
    everyone = ranks.gather(problems, "verifying its checksums") if ranks else [problems]
    _raise(list(dict.fromkeys(p for own in everyone for p in own)), path)


def _open(path: str) -> tuple[Metadata, int]:
    """The DCP metadata and saving world size of a pdcompile checkpoint (verified first)."""
    try:
        metadata = read_metadata(path)  # allow-listed unpickling: nothing in it runs
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint {path}: not a checkpoint: no readable .metadata file "
            f"({type(exc).__name__}); the path is wrong or a save did not finish"
        ) from exc
    if bytes_entries := [
        key for key, e in metadata.state_dict_metadata.items()
        if not isinstance(e, TensorStorageMetadata)
    ]:  # fmt: skip
        raise CheckpointError(
            f"checkpoint {path}: holds non-tensor entries {bytes_entries[:3]}, which loading "
            "would unpickle; pdcompile checkpoints hold tensors only: not opened"
        )
    entry = metadata.state_dict_metadata.get(_FORMAT)
    if not isinstance(entry, TensorStorageMetadata) or entry.size != (2,):
        raise CheckpointError(
            f"checkpoint {path}: a torch.distributed.checkpoint directory but not a pdcompile "
            f"checkpoint (no {_FORMAT!r} entry): read it with torch.distributed.checkpoint.load"
        )
    mark = {_FORMAT: empty(metadata, _FORMAT)}
    with _dcp(path, 0):
        dcp.load(mark, storage_reader=Reader(path), no_dist=True)
    version, world_size = mark[_FORMAT].tolist()
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: format {version} is newer than this "
            f"pdcompile's ({FORMAT_VERSION}): upgrade pdcompile"
        )
    return metadata, world_size


def _raise(problems: list[str], path: str) -> None:
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"checkpoint {path}: " + "; ".join(problems[:5]) + more)


@contextlib.contextmanager
def _dcp(path: str, rank: int, grouped: bool = False, writing: bool = False) -> Iterator[None]:
    """Around a DCP call: its single-process warning silenced, its failures a CheckpointError
    (under a group, a collective's own failure is left to `Ranks.phase`)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except (Exception, dcp.CheckpointException) as exc:  # the latter gathers every rank's
        if grouped and isinstance(exc, RuntimeError) and not isinstance(exc, PdcompileError):
            raise  # a timeout or a dead peer in one of DCP's collectives
        failures = getattr(exc, "failures", None) or {rank: (exc, None)}
        why = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in failures.items())
        fix = "write to it" if writing else "read it whole (a save may have been cut short)"
        raise CheckpointError(
            f"checkpoint {path}: {'writing' if writing else 'reading'} failed: {why}; every rank "
            f"must see the folder (a shared filesystem) and {fix}"
        ) from exc
