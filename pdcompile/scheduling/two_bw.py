"""`2bw`: PipeDream-2BW (Narayanan et al., ICML 2021): double-buffered weight updates.

Every stage updates once per step of M microbatches from the gradient computed on the weights
before the previous update, W(t - 1) (the first two steps on W(0)); steps stream without a
flush, and two weight versions suffice. Each replica runs PipeDream's warm-up capped at
M // r_s (so no forward of step t + 2 comes before update t). Needs M >= S and r_s | M. Equal
stages, one per rank, in the steady state: M (F + B) per call, no bubble.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.closed_forms import WARMUP_STREAMED
from pdcompile.scheduling.placement import Placement
from pdcompile.scheduling.registry import register_schedule
from pdcompile.scheduling.warmup_orders import WarmupSchedule
from pdcompile.scheduling.weight_policy import WeightPolicy


def two_bw_version(num_microbatches: int, microbatch: int, first_step: int = 0) -> int:
    """Updates in the weights microbatch k's forward and backward use (every stage alike): it
    belongs to step t = first_step + k // M, which computes on W(t - 1), the first two steps on
    W(0). `first_step` is the updates made before the stream (re)started.

    >>> [two_bw_version(2, k) for k in range(8)]
    [0, 0, 0, 0, 1, 1, 2, 2]
    """
    if num_microbatches < 1 or microbatch < 0 or first_step < 0:
        raise ScheduleError(
            f"2bw versions need num_microbatches >= 1, microbatch >= 0 and first_step >= 0, "
            f"got {num_microbatches}, {microbatch}, {first_step}"
        )
    return max(0, first_step + microbatch // num_microbatches - 1)


class TwoBWWeights(WeightPolicy):
    """Double-buffered updates: step t computes on W(t - 1), two weight versions."""

    streaming = True
    keeps_previous = True

    def weight_version(
        self, placement: Placement, stage: int, microbatch: int, vertical: bool = False
    ) -> int | None:
        return microbatch // placement.num_microbatches - 1

    def version(self, placement: Placement, stage: int, minibatch: int) -> int:
        return two_bw_version(placement.num_microbatches, minibatch)

    def stashed_versions(self, placement: Placement, stage: int, in_flight: int) -> int:
        """The copy the step computes on, and, on a stage with a warm-up (more than one
        microbatch in flight), the next step's, whose forwards start before this step's last
        backward."""
        return 2 if in_flight > 1 else 1

    def steady_calls(self, placement: Placement, warmups: Sequence[int]) -> int:
        """One more than the default: the first two steps share the first weights (the second
        call copies them less often than the later ones)."""
        return super().steady_calls(placement, warmups) + 1


@register_schedule("2bw")
class TwoBW(WarmupSchedule):
    """PipeDream-2BW: one update per step on one-step-stale weights, two versions, no flush."""

    meaning = (
        "PipeDream-2BW: one update per step from the gradient computed on the weights "
        "before the previous update (one step stale), two weight versions, no flush: consecutive "
        "steps overlap, and microbatches stay in flight across train_step calls until flush()."
    )
    weights = TwoBWWeights()
    closed_forms = WARMUP_STREAMED

    def check(
        self, replicas: Sequence[int], num_microbatches: int, ties: Sequence[Sequence[int]] = ()
    ) -> None:
        super().check(replicas, num_microbatches)
        if num_microbatches < len(replicas):
            raise ScheduleError(
                f"2bw needs at least as many microbatches as stages ({len(replicas)}), got "
                f"{num_microbatches}; raise num_microbatches"
            )
        if any(num_microbatches % r for r in replicas):
            raise ScheduleError(
                f"2bw streams steps, so every replica of a stage must hold as many microbatches "
                f"of each step (replicas {list(replicas)}); give a number of microbatches that "
                f"every replica count divides, got {num_microbatches}"
            )

    def warmup(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """PipeDream's w_s capped at M // r_s, the microbatches a replica holds of every step:
        so no forward of step t + 2 comes before its update t, and two weight versions
        suffice. The cap binds only when M < sum_{t>=s} r_t - 1."""
        return min(super().warmup(replicas, stage, num_microbatches),
                   num_microbatches // replicas[stage])  # fmt: skip
