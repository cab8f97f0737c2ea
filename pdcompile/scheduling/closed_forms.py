"""A schedule's optional closed forms: its step time and memory counts as formulas. Torch-free.

A kind may give formulas (`ClosedForms`, its schedule's `closed_forms`) for equal stages: the
seconds of a `train_step` call, its bubble, and per replica the microbatches it holds at most. A
fast estimate, checked against simulating the kind's own actions (`tests/test_schedule_truth.py`,
`tests/test_schedule_conformance.py`). Where a kind gives none, the memory counts are derived by
walking its orders (`memory_walk.py`) and its step time is simulated: a kind never inherits
another kind's formulas (a subclass gives its own or none).

Each form is a function whose first argument is the schedule (its rules):

    step_time(rules, num_stages, num_microbatches, forward_s, backward_s, *, weight_s, chunks)
    bubble(rules, num_stages, num_microbatches, forward_s, backward_s, *, weight_s, chunks)
    in_flight(rules, replicas, stage, num_microbatches, *, chunks)
    deferred(rules, replicas, stage, num_microbatches)

`weight_s` is the weight-gradient part W of the fused `backward_s` (None: the simulator's split,
`split_parts`); `chunks` the stages per rank (`num_stages` = chunks x ranks). `in_flight`: the
microbatches (of a chunked layout: microbatch-chunks of the rank running `stage`, all its
stages together) a replica of `stage` holds at most, counting those whose weight gradient W
alone is pending; `deferred`: of them, those with only W pending.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SPLIT = 0.5  # a stage's input-gradient part I takes this share of its backward_s, W the rest


def split_parts(backward_s: float, weight_s: float | None = None) -> tuple[float, float]:
    """(I, W): the input- and weight-gradient parts of a fused backward of `backward_s`
    seconds, W being `weight_s` (None: the share 1 - `SPLIT`, as the simulator prices them)."""
    w = (1 - SPLIT) * backward_s if weight_s is None else weight_s
    return backward_s - w, w


@dataclass(frozen=True)
class ClosedForms:
    """The formulas a kind gives (docs in the module); None: not given."""

    step_time: Callable[..., float] | None = None
    bubble: Callable[..., float] | None = None
    in_flight: Callable[..., int] | None = None
    deferred: Callable[..., int] | None = None


def flushed_step_time(
    rules: Any, num_stages: int, num_microbatches: int, forward_s: float, backward_s: float,
    *, weight_s: float | None = None, chunks: int = 1,
) -> float:  # fmt: skip
    """A synchronous step that fills and drains within the call: (M + S - 1)(F + B)."""
    return (num_microbatches + num_stages - 1) * (forward_s + backward_s)


def streamed_step_time(
    rules: Any, num_stages: int, num_microbatches: int, forward_s: float, backward_s: float,
    *, weight_s: float | None = None, chunks: int = 1,
) -> float:  # fmt: skip
    """A stream's steady-state call: M (F + B) + (S - 1) F. It never drains, but every call
    ends with the loss reaching every rank, so the next call's forwards refill the pipeline."""
    return num_microbatches * (forward_s + backward_s) + (num_stages - 1) * forward_s


def warmup_in_flight(
    rules: Any, replicas: Any, stage: int, num_microbatches: int, *, chunks: int = 1
) -> int:
    """A replica's warm-up and the one forward after it (`rules.warmup`): a synchronous step
    holds no more than it runs; a stream never drains, so its steady state holds them all."""
    held = rules.warmup(replicas, stage, num_microbatches) + 1
    return held if rules.streaming else min(held, -(-num_microbatches // replicas[stage]))


def v_bubble(step_time: Callable[..., float]) -> Callable[..., float]:
    """The bubble of a V kind (two stages per rank, whatever `chunks`) whose step time is
    `step_time`: 1 - 2M(F + B) / step_time."""

    def bubble(
        rules: Any, num_stages: int, num_microbatches: int, forward_s: float,
        backward_s: float, *, weight_s: float | None = None, chunks: int = 2,
    ) -> float:  # fmt: skip
        step = step_time(rules, num_stages, num_microbatches, forward_s, backward_s,
                         weight_s=weight_s)  # fmt: skip
        return 1 - 2 * num_microbatches * (forward_s + backward_s) / step if step else 0.0

    return bubble


WARMUP_FLUSHED = ClosedForms(step_time=flushed_step_time, in_flight=warmup_in_flight)
WARMUP_STREAMED = ClosedForms(step_time=streamed_step_time, in_flight=warmup_in_flight)
