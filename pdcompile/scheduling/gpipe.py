"""`gpipe`: synchronous, every forward of the step, then every backward (GPipe).

Equal stages, one per rank: step (M + S - 1)(F + B), bubble (S - 1) / (M + S - 1), every one
of a replica's microbatches in flight at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcompile.scheduling.closed_forms import WARMUP_FLUSHED
from pdcompile.scheduling.registry import register_schedule
from pdcompile.scheduling.warmup_orders import WarmupSchedule


@register_schedule("gpipe")
class GPipe(WarmupSchedule):
    """Synchronous GPipe: all forwards, then all backwards; every microbatch in flight."""

    meaning = (
        "synchronous: all forwards, then all backwards, one update per step; the same "
        "optimisation as 1f1b with more activations in flight."
    )
    closed_forms = WARMUP_FLUSHED

    def warmup(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """Every microbatch of the replica."""
        return -(-num_microbatches // replicas[stage])
