"""A model on the meta device: captured and costed there, each rank filling only its own
stages' tensors (`compile(weights=)`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from pdcompile.core.errors import CheckpointError, PdcompileError
from pdcompile.runtime.train_config import Weights


def on_meta(module: nn.Module) -> bool:
    """Whether `module` holds any tensor on the meta device (a model without values)."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def to_meta(value: Any) -> Any:
    """`value` with every tensor in it (within tuples, lists, dicts) moved to the meta device."""
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: to_meta(v) for k, v in value.items()}
    return value


def materialize(stages: list[nn.Module], device: torch.device, weights: Weights) -> None:
    """Give the stages this process runs real tensors on `device`, filled from `weights`
    (the other stages stay on the meta device: nothing of them is allocated here)."""
    if weights is None:
        raise PdcompileError(
            "the model is on the meta device: pass weights= (a function returning its state "
            "dict, or a checkpoint directory) so that each rank can fill its own stage"
        )
    if isinstance(weights, str):
        from pdcompile.runtime.checkpoint import load_full_state_dict

        state = load_full_state_dict(weights)
    else:
        state = weights()
    for stage in stages:
        _fill(stage, device, state)


def _fill(stage: nn.Module, device: torch.device, state: dict[str, torch.Tensor]) -> None:
    """Allocate `stage` on `device` and load its tensors from `state` by their original names,
    a tied parameter staying one tensor under all its names."""
    aliases: dict[int, list[str]] = {}
    for name, param in stage.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    stage.to_empty(device=device)
    for names in aliases.values():  # one tensor under all its names, as before
        first = stage.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(stage.get_submodule(owner), attr, first)
    needed = stage.state_dict().keys()
    missing = [n for n in needed if n not in state]
    if missing:
        raise CheckpointError(
            f"weights= lacks {len(missing)} tensors the stage needs, e.g. {missing[:3]}; "
            "give the whole model's state dict (original names)"
        )
    stage.load_state_dict({n: state[n] for n in needed})
