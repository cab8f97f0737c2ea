"""Activation recomputation (a plan's `Stage.recompute`): a stage's forward keeps only its inputs
or its segments' boundaries, and its backward runs the forward again.

The forward runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False,
preserve_rng_state=True)`: autograd saves only the checkpoint's inputs (the probe of
`runtime/memory_probe.py` sees them as the stage's saved activations), and the backward reruns
the function with the RNG as the first time (dropout draws the same masks, CPU and CUDA) and
the same autocast. The function swaps the microbatch's weight version into the stage's slots
each time it runs, so the recomputation computes on the version the forward used.

- `True`: one checkpoint around the stage's call (on the last stage, with the loss: the loss's
  saved tensors, a GPT's log-probabilities, are recomputed too).
- Boundary nodes: the stage cut into segments (`pdcompile/lowering/stage_segments.py`), one
  checkpoint each; the backward recomputes one segment at a time, from the values before it.
- A split backward (`zb-*`): the forward keeps only the stage's inputs (segments make no
  difference there), and I runs the stage's forward again, whole, with the forward's RNG
  state; I and W then share that graph, as without recomputation. Under the checkpoint, W would
  recompute once more for every group of weights it differentiates (a GPT stage: 9 forwards for
  one microbatch's W), and a `torch.utils.checkpoint.GraphExecGroup` spanning I and W refuses a
  saved tensor both parts read (a layer norm's input).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch.utils.checkpoint import (
    DefaultDeviceType,
    checkpoint,
    get_device_states,
    set_device_states,
)

from pdcompile.core.errors import CodegenError
from pdcompile.core.ir import accept_constants
from pdcompile.lowering.stage_segments import Segment, cut_stage

__all__ = ["Forward", "Recompute", "entered"]

Context = Callable[[], contextlib.AbstractContextManager]
LossOf = Callable[[Any], torch.Tensor]


class Forward(NamedTuple):
    """A recomputed stage's forward: its outputs, its loss (the last stage, else None) and,
    under a split backward, `again()`: the same forward run again, whole, with the RNG as the
    first time, giving (outputs, loss) with their graph."""

    outputs: Any
    loss: torch.Tensor | None
    again: Callable[[], tuple[Any, torch.Tensor | None]] | None = None


@contextlib.contextmanager
def entered(*contexts: contextlib.AbstractContextManager) -> Iterator[None]:
    """Inside all of `contexts`, entered in order."""
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


class Recompute:
    """How one stage replica's forwards keep and recompute their activations.

    Args:
        module: the stage module (a GraphModule from `pdcompile.lowering`).
        spec: the plan's `Stage.recompute`: True or the boundary nodes.
        stage: its index.
        split: the schedule splits the backward into I and W.

    Raises:
        CodegenError: a boundary is not a node of the stage computing one tensor.
    """

    def __init__(
        self, module: fx.GraphModule, spec: bool | tuple[str, ...], *, stage: int, split: bool
    ) -> None:
        self.module, self.stage, self.split = module, stage, split
        boundaries = () if spec is True else tuple(spec)
        segments = cut_stage(module, boundaries, stage) if boundaries else []  # checked always
        self.segments: list[Segment] = [] if split else segments
        self.boundaries = frozenset(boundaries)
        self.signature = inspect.signature(module.forward)
        self.placeholders = [n.name for n in module.graph.find_nodes(op="placeholder")]

    def forward(
        self, args: tuple, kwargs: dict[str, Any], context: Context, loss_of: LossOf | None
    ) -> Forward:
        """Run the stage's forward on `args`/`kwargs` under checkpoints.

        Args:
            context: a new context manager for every run of the stage's code, the first and
                the recomputation (autocast, the weight version's swap).
            loss_of: on the last stage, `output -> loss`, run after the context, inside the
                checkpoint.
        """
        values = self._bind(args, kwargs)
        whole = functools.partial(self._whole, context, loss_of)
        if not self.segments:
            again = None
            if self.split:
                again = functools.partial(_again, _RngState.take(values), whole, values)
            outputs, loss = _checkpointed(whole, values, loss_of)
            return Forward(outputs, loss, again)
        known = dict(zip(self.placeholders, values, strict=True))
        *leading, last = self.segments
        for segment in leading:
            run = functools.partial(self._segment, segment, context, None, False)
            result = _checkpointed(run, [known[name] for name in segment.inputs], None)
            for name, value in zip(segment.outputs, result, strict=True):
                if name in self.boundaries and not isinstance(value, torch.Tensor):
                    raise CodegenError(
                        f"stage {self.stage}: recompute boundary {name!r} computes a value of "
                        f"type {type(value).__name__}, not a tensor; choose a node computing one "
                        "tensor (pdcompile.lowering.stage_segments.boundary_choices)"
                    )
                known[name] = value
        run = functools.partial(self._segment, last, context, loss_of, True)
        return Forward(*_checkpointed(run, [known[name] for name in last.inputs], loss_of))

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        """The call's values in the order of the stage's inputs (positional, so that the
        checkpoint saves them where the memory probe sees them)."""
        constants = getattr(self.module, "_call_constants", ())
        rest = accept_constants(constants, kwargs, self.module._get_name())
        bound = self.signature.bind(*args, **rest)  # a TypeError as the call would raise
        bound.apply_defaults()
        return list(bound.args)

    def _whole(
        self, context: Context, loss_of: LossOf | None, *values: Any
    ) -> tuple[Any, torch.Tensor | None]:
        with context():
            outputs = self.module(*values)
        return outputs, (loss_of(outputs) if loss_of is not None else None)

    def _segment(
        self, segment: Segment, context: Context, loss_of: LossOf | None, last: bool, *values: Any
    ) -> Any:
        with context():
            result = segment(self.module, *values)
        if not last:
            return result
        return result, (loss_of(result) if loss_of is not None else None)


def _checkpointed(fn: Callable[..., Any], values: list[Any], loss_of: LossOf | None) -> Any:
    """`fn(*values)` under a checkpoint. One holding the loss recomputes to its end: an early
    stop raises inside it, which the loss's checks would report as the loss function's error."""
    return checkpoint(
        fn, *values, use_reentrant=False, preserve_rng_state=True, early_stop=loss_of is None
    )


@dataclass(frozen=True)
class _RngState:
    """The CPU generator's state and those of the accelerators the inputs live on."""

    cpu: torch.Tensor
    devices: list[int]
    states: list[torch.Tensor]

    @classmethod
    def take(cls, values: list[Any]) -> _RngState:
        devices, states = get_device_states(*values)
        return cls(torch.get_rng_state(), devices, states)


def _again(
    rng: _RngState, whole: Callable[..., Any], values: list[Any]
) -> tuple[Any, torch.Tensor | None]:
    """`whole(*values)` with the RNG as `rng` (the global generators untouched afterwards)."""
    device_type = DefaultDeviceType.get_device_type()
    with torch.random.fork_rng(devices=rng.devices, device_type=device_type):
        torch.set_rng_state(rng.cpu)
        set_device_states(rng.devices, rng.states, device_type=device_type)
        return whole(*values)
