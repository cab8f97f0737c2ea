"""`1f1b`: synchronous one-forward-one-backward (PipeDream-Flush, Megatron's schedule).

Each replica runs PipeDream's w_s warm-up forwards, then a forward and a backward alternately,
then the remaining backwards; gradients of all microbatches are accumulated and every stage
updates once, at the end of the step. Equal stages, one per rank: step (M + S - 1)(F + B),
bubble (S - 1) / (M + S - 1), at most S - s microbatches in flight at stage s.
"""

from __future__ import annotations

from pdcompile.scheduling.closed_forms import WARMUP_FLUSHED
from pdcompile.scheduling.registry import register_schedule
from pdcompile.scheduling.warmup_orders import WarmupSchedule


@register_schedule("1f1b")
class OneForwardOneBackward(WarmupSchedule):
    """Synchronous 1F1B (PipeDream-Flush): one update per step, S - s microbatches in flight."""

    meaning = (
        "synchronous (PipeDream-Flush): gradients of all microbatches are accumulated, each "
        "weighted by its share of the batch, and every stage updates once per step: exactly "
        "single-process gradient accumulation; the pipeline drains at every step (a bubble)."
    )
    closed_forms = WARMUP_FLUSHED
