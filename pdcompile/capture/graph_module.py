"""The GraphModule type `trace` returns: a graph that computes the mode it was captured in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx
import torch.nn as nn

from pdcompile.core.errors import TraceError
from pdcompile.core.ir import accept_constants


class CapturedGraphModule(fx.GraphModule):
    """A captured graph, fixed to the train or eval mode of the model when it was captured.

    Capture evaluates `self.training` checks in traced-through code (and torch.export also bakes
    dropout and BatchNorm behaviour into the graph), so a graph cannot honestly switch mode:
    `train()`/`eval()` to the other mode raise instead of computing a mixture. Capture once per
    mode instead.

    The graph takes its tensor inputs, by position or by name, and the constant arguments it
    was captured with (by name, same value: `use_cache=False`); see `bind_constants`.
    """

    def __init__(self, root: nn.Module, graph: fx.Graph, class_name: str, training: bool) -> None:
        super().__init__(root, graph, class_name)
        self._captured_training = training
        self.training = training
        self._call_constants: tuple[tuple[str, str], ...] = ()
        self.register_forward_pre_hook(_strip_constants, with_kwargs=True)

    def bind_constants(self, constants: Sequence[tuple[str, str]]) -> None:
        """Accept these `(argument, repr(value))` pairs as keyword arguments of a call."""
        self._call_constants = tuple(constants)

    def train(self, mode: bool = True) -> CapturedGraphModule:
        if mode != self._captured_training:
            captured = "train" if self._captured_training else "eval"
            wanted = "train" if mode else "eval"
            raise TraceError(
                f"this graph was captured in {captured} mode and computes that mode only; to get "
                f"{wanted} mode, call model.{wanted}() and pdcompile.trace again"
            )
        return self

    def __deepcopy__(self, memo: dict) -> CapturedGraphModule:
        copied = super().__deepcopy__(memo)  # fx rebuilds the module without calling __init__
        copied._captured_training = self._captured_training
        copied._call_constants = self._call_constants
        if _strip_constants not in copied._forward_pre_hooks.values():
            copied.register_forward_pre_hook(_strip_constants, with_kwargs=True)
        return copied


def _strip_constants(
    module: CapturedGraphModule, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    constants = getattr(module, "_call_constants", ())
    if not constants or not kwargs:
        return None
    return args, accept_constants(constants, kwargs, module._get_name())
