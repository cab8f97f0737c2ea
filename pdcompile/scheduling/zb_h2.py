"""`zb-h2`: zero-bubble ZB-H2 (Qi et al., ICLR'24): a longer warm-up, W's fill the drain.

Like `zb-h1` (each backward split into I, the input gradients sent back at once, and W, the
weight gradients run later), but stage s runs twice 1F1B's warm-up, 2 w_s forwards, so that
forwards fill the wait for its first I, and leaves d_s = 2(max_t w_t - w_s) W's waiting (a
straight pipeline: 2(p - 1 - s) warm-up forwards, d_s = 2s), so that W's fill the drain
(`chunks.split_order`). The price is memory: every stage holds 2p - 1 microbatches in flight
(counting one whose W is pending), against 1F1B's p - s (p on the first stage): 2p - 1 - 2s
whose I is pending and up to 2s with only W left. Needs M >= 2D - 1 microbatches (D devices),
what the warm-up fills. Synchronous: one update per step from every microbatch, so gradient
clipping and the non-finite check stay global and exact.

Equal stages, one per rank (F, I, W per microbatch; B = I + W), M >= 2p - 1: a call takes
M(F + I + W) + (p - 1) max(F, I - F, F + I - 2W), which is M(F + I + W) + (p - 1)F, the fill
no single call avoids (the last stage starts (p - 1)F late), whenever I <= 2F and I <= 2W.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.chunks import ranks_and_chunks, split_order
from pdcompile.scheduling.closed_forms import ClosedForms, split_parts
from pdcompile.scheduling.registry import register_schedule
from pdcompile.scheduling.warmup_orders import WarmupSchedule
from pdcompile.scheduling.zb_h1 import deferred


def _step_time(
    rules: ZeroBubbleH2, num_stages: int, num_microbatches: int, forward_s: float,
    backward_s: float, *, weight_s: float | None = None, chunks: int = 1,
) -> float:  # fmt: skip
    """M(F + I + W) + (p - 1) max(F, I - F, F + I - 2W) (M >= 2p - 1)."""
    f, (i, w) = forward_s, split_parts(backward_s, weight_s)
    p, m = num_stages, num_microbatches
    return m * (f + i + w) + (p - 1) * max(f, i - f, f + i - 2 * w)


def _in_flight(
    rules: ZeroBubbleH2, replicas: Sequence[int], stage: int, num_microbatches: int, *,
    chunks: int = 1,
) -> int:  # fmt: skip
    """Twice the deepest warm-up and one forward (at most the replica's microbatches): 2p - 1
    on a straight pipeline."""
    deepest = max(rules.one_f_one_b_warmup(replicas, t, num_microbatches)
                  for t in range(len(replicas)))  # fmt: skip
    return min(2 * deepest + 1, -(-num_microbatches // replicas[stage]))


@register_schedule("zb-h2")
class ZeroBubbleH2(WarmupSchedule):
    """ZB-H2: twice 1F1B's warm-up, W's fill the drain; 2p - 1 microbatches in flight."""

    meaning = (
        "synchronous (zero-bubble ZB-H2): each backward is split into the input gradients, "
        "sent back at once, and the weight gradients, computed later; a longer warm-up and "
        "the weight gradients fill the pipeline's fill and drain, at the cost of 2p - 1 "
        "microbatches' activations in flight on every stage; every stage updates once per step "
        "from all microbatches: exactly single-process gradient accumulation."
    )
    items_per_microbatch = 3
    closed_forms = ClosedForms(step_time=_step_time, in_flight=_in_flight, deferred=deferred)

    def check(
        self, replicas: Sequence[int], num_microbatches: int, ties: Sequence[Sequence[int]] = ()
    ) -> None:
        super().check(replicas, num_microbatches)
        least = 2 * sum(replicas) - 1
        if num_microbatches < least:
            raise ScheduleError(
                f"{self.name} fills its warm-up with 2D - 1 = {least} microbatches on "
                f"{sum(replicas)} devices, got {num_microbatches}; raise num_microbatches or use "
                "zb-h1"
            )

    def check_layout(self, ranks: Sequence[Sequence[int]], num_microbatches: int) -> None:
        _, v = ranks_and_chunks(ranks)
        if v > 1:
            raise ScheduleError(
                f"{self.name} runs one stage per rank, got ranks {[list(r) for r in ranks]}; "
                "for several stages per rank use zb-h1 (chunks=v) or zb-v"
            )

    def one_f_one_b_warmup(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """1F1B's (PipeDream's) warm-up of a replica of `stage`."""
        return super().warmup(replicas, stage, num_microbatches)

    def warmup(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """Twice 1F1B's (PipeDream's) warm-up."""
        return 2 * self.one_f_one_b_warmup(replicas, stage, num_microbatches)

    def defer(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """W's a replica of `stage` leaves waiting: 2(max_t w_t - w_s), w 1F1B's warm-up."""
        deepest = max(self.one_f_one_b_warmup(replicas, t, num_microbatches)
                      for t in range(len(replicas)))  # fmt: skip
        return 2 * (deepest - self.one_f_one_b_warmup(replicas, stage, num_microbatches))

    def replica_order(
        self, replicas: Sequence[int], stage: int, num_microbatches: int, mine: Sequence[int]
    ) -> list[tuple[str, int]]:
        w = self.warmup(replicas, stage, num_microbatches)
        return split_order(mine, w, self.defer(replicas, stage, num_microbatches))
