"""The entries of a checkpoint's flat dictionary, and back (key layout: `runtime/checkpoint.py`).

`optim/<name>/...` holds an optimizer's state and numeric hyperparameters under every name of
each parameter; `encode` turns a tensor or a Python number into an entry (a number becomes a
tensor, remembered as a scalar); `empty` makes the tensor DCP reads an entry into.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pdcompile.core.errors import CheckpointError

_NUMBERS = (bool, int, float)
# param group entries kept from the loading optimizer: how it runs, not what it computes
_OPTIONS = {"params", "foreach", "fused", "capturable", "differentiable"}


def optimizer_items(
    model: nn.Module, optimizer: torch.optim.Optimizer, items: dict[str, torch.Tensor]
) -> list[str]:
    """Add the optimizer's state and hyperparameters under every name of each parameter."""
    names, problems = param_names(model), []
    for group in optimizer.param_groups:
        hyper = {k: _hyper(v) for k, v in group.items() if k not in _OPTIONS}
        for param in group["params"]:
            if id(param) not in names:
                problems.append(
                    f"the optimizer holds a {list(param.shape)} parameter that the "
                    "module does not: build it from the module's parameters"
                )
            for name in names.get(id(param), []):
                items.update(
                    {f"optim/{name}/hyper/{k}": v for k, v in hyper.items() if v is not None}
                )
                for key, value in optimizer.state.get(param, {}).items():
                    if value is not None:  # e.g. SGD's momentum_buffer before its first step
                        what = f"optimizer state {key!r} of {name!r}"
                        problems += encode(f"optim/{name}/", key, value, items, what)
    return problems


def optimizer_reads(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    metadata: Metadata,
    reads: dict[str, torch.Tensor],
    problems: list[str],
) -> list[str | None]:
    """Add the optimizer's entries to `reads`; per parameter (state_dict order), the name used."""
    by_name: dict[str, list[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith("optim/"):
            by_name.setdefault(key[len("optim/") :].rsplit("/", 2)[0], []).append(key)
    names, chosen = param_names(model), []
    for param in (p for group in optimizer.param_groups for p in group["params"]):
        aliases = names.get(id(param), [])
        chosen.append(next((n for n in aliases if n in by_name), None))
        if chosen[-1] is None:
            problems.append(
                f"no optimizer state for parameter {aliases or list(param.shape)}: "
                "it was saved without an optimizer, or from another model"
            )
        reads.update({key: empty(metadata, key) for key in by_name.get(chosen[-1] or "", [])})
    return chosen


def restore_optimizer(
    optimizer: torch.optim.Optimizer, chosen: list[str | None], reads: dict, path: str
) -> None:
    """Hand what `optimizer_reads` read to `optimizer.load_state_dict` (its device rules)."""
    by_name: dict[str, list[tuple[str, str, torch.Tensor]]] = {}
    for key, value in reads.items():
        if key.startswith("optim/"):
            name, kind, entry = key[len("optim/") :].rsplit("/", 2)
            by_name.setdefault(name, []).append((kind, entry, value))
    state: dict[int, dict[str, Any]] = {}
    groups = []
    for group in optimizer.state_dict()["param_groups"]:
        group, saved = dict(group), {}
        for index in group["params"]:
            for kind, entry, value in by_name.get(chosen[index] or "", []):
                if kind != "hyper":
                    state.setdefault(index, {})[entry] = value if kind == "tensor" else value.item()
                elif entry in saved and not torch.equal(saved[entry][1], value):
                    raise CheckpointError(
                        f"checkpoint {path}: {saved[entry][0]!r} and {chosen[index]!r} were saved "
                        f"with {entry} {saved[entry][1].tolist()} and {value.tolist()} but share "
                        "a param group here: give them separate param groups"
                    )
                elif entry in group:
                    saved[entry] = (chosen[index], value)
        group.update({entry: _like(group[entry], value) for entry, (_, value) in saved.items()})
        groups.append(group)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def encode(prefix: str, key: str, value: Any, items: dict, what: str) -> list[str]:
    """Add a tensor or a Python number (as a tensor, remembered as one) to `items`."""
    if isinstance(value, torch.Tensor):
        items[f"{prefix}tensor/{key}"] = value.detach()
    elif isinstance(value, _NUMBERS):
        items[f"{prefix}scalar/{key}"] = _hyper(value)
    else:
        return [
            f"{what} is a {type(value).__name__}; checkpoints hold tensors and Python bool, "
            "int, float values: convert it to a tensor"
        ]
    return []


def _hyper(value: Any) -> torch.Tensor | None:
    """A number, tuple of numbers or tensor as a tensor (float64 keeps a float exact), or None."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    numbers = isinstance(value, tuple | list) and all(isinstance(v, _NUMBERS) for v in value)
    ok = isinstance(value, float) or (numbers and len(value) > 0)
    return torch.tensor(value, dtype=torch.float64) if ok else None  # None, str: loader's own


def _like(current: Any, value: torch.Tensor) -> Any:
    """A saved hyperparameter as a tensor or sequence like the loader's value, else a number."""
    if isinstance(current, torch.Tensor):
        return value.to(dtype=current.dtype, device=current.device)
    return type(current)(value.tolist()) if isinstance(current, tuple | list) else value.item()


def empty(metadata: Metadata, key: str) -> torch.Tensor:
    entry = metadata.state_dict_metadata[key]
    assert isinstance(entry, TensorStorageMetadata), key
    return torch.empty(entry.size, dtype=entry.properties.dtype)


def param_names(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def state_entries(state: Any, prefix: str) -> dict[str, Any]:
    """The numbers of a nested state (an LR scheduler's `state_dict()`) as `extra` values keyed
    by their path: numbers as they are, sequences of numbers as int64 or float64 tensors,
    tensors as they are. Strings, None and callables are configuration, not state: left out."""
    if isinstance(state, _NUMBERS) or isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, tuple | list) and state and all(isinstance(v, _NUMBERS) for v in state):
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in state)
        return {prefix: torch.tensor(state, dtype=torch.int64 if ints else torch.float64)}
    if isinstance(state, dict):
        parts = state.items()
    elif isinstance(state, tuple | list):
        parts = enumerate(state)
    else:
        return {}
    entries = {}
    for key, value in parts:
        entries.update(state_entries(value, f"{prefix}/{key}"))
    return entries


def restore_state(current: Any, entries: dict[str, Any], prefix: str) -> Any:
    """`current` (a fresh `state_dict()`) with the values `state_entries` saved under `prefix`,
    each converted to the type it has in `current`."""
    if prefix in entries:
        value = entries[prefix]
        if isinstance(current, torch.Tensor):
            return value.to(dtype=current.dtype, device=current.device)
        if isinstance(current, tuple | list):
            return type(current)(value.tolist())
        return type(current)(value.item() if isinstance(value, torch.Tensor) else value)
    if isinstance(current, dict):
        return {k: restore_state(v, entries, f"{prefix}/{k}") for k, v in current.items()}
    if isinstance(current, tuple | list):
        parts = (restore_state(v, entries, f"{prefix}/{i}") for i, v in enumerate(current))
        return type(current)(parts)
    return current


def transfer(sources: Iterable[Any], targets: Iterable[Any]) -> None:
    """Hand the state of one process's stage workers (`sources`: a plan's) to its workers of
    another plan of the same model (`targets`), by name, as a checkpoint would: parameters and
    buffers, optimizer state and hyperparameters (`optimizer_items` / `restore_optimizer`),
    update and skip counts, LR scheduler state.

    Raises:
        CheckpointError: a target holds a name no source holds.
    """
    sources = list(sources)
    items: dict[str, torch.Tensor] = {}
    for w in sources:
        for name, tensor in w.module.state_dict().items():
            items.setdefault(f"model/{name}", tensor)
        problems = optimizer_items(w.module, w.optimizer, items)
        if problems:
            raise CheckpointError(f"cannot move the optimizer state: {problems[0]}")
    first = sources[0]
    updates, skipped = first.versions.updates, first.skipped
    scheduler = state_entries(first.scheduler.state_dict(), "s") if first.scheduler else {}
    for w in targets:
        state = w.module.state_dict()
        missing = [n for n in state if f"model/{n}" not in items]
        if missing:
            raise CheckpointError(f"the running stages hold none of {missing[:3]}: another model")
        w.module.load_state_dict({n: items[f"model/{n}"] for n in state})
        names = param_names(w.module)
        params = [p for group in w.optimizer.param_groups for p in group["params"]]
        held = {key.rsplit("/", 2)[0].removeprefix("optim/") for key in items if "optim/" in key}
        chosen = [next((n for n in names.get(id(p), []) if n in held), None) for p in params]
        mine = {k: v.clone() for k, v in items.items() if k.startswith("optim/")}  # replicas
        restore_optimizer(w.optimizer, chosen, mine, "<the running plan>")
        w.versions.updates, w.skipped = updates, skipped
        if w.scheduler is not None:
            w.scheduler.load_state_dict(restore_state(w.scheduler.state_dict(), scheduler, "s"))
