"""`zb-v`: zero-bubble ZB-V (Qi et al., ICLR'24, section 6): two stages per rank in a V.

The model is cut into 2p stages on p ranks: the rank at position r runs stage r (down the V)
and stage 2p - 1 - r (back up), so the first and the last stage share rank 0 and the loss is
computed where the input was read. Backwards are split into I (input gradients, sent back at
once) and W (weight gradients, run to fill bubbles); each rank runs the ZB-V order
(`chunks.v_order`, as torch's `ScheduleZBVZeroBubble`): a warm-up of forwards down and up,
then per microbatch a forward, I and W down and a forward, I and W up, then a cool-down of I's
with the W's filling the drain. Each rank holds at most 2p microbatch-chunks in flight
(counting one whose W is pending), half a rank's activations each: 1F1B's peak, p
microbatches. Needs M >= 2p - 1 (what the V fills). Synchronous: one update per step.

Equal stages (F, I, W per microbatch and stage; B = I + W), M >= 2p - 1: a call takes
2M(F + I + W) plus the largest of (p - 1)I, max(F, I) + (p - 2)W, (2p - 3)F - (p - 2)I,
(2p - 2)F - (p - 1)I - W, 2(p - 1)(I - W), (2p - 2)F - (2p - 1)W and
(2p - 3)F + I - (2p - 2)W: with F = I = W, 6MF + (p - 1)F, a bubble of (p - 1) / (6M + p - 1),
half of `zb-h1`'s on p ranks of one stage each (whose stages are twice as long).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcompile.scheduling.base import PipelineSchedule
from pdcompile.scheduling.chunks import VPlacement, v_order
from pdcompile.scheduling.closed_forms import ClosedForms, split_parts, v_bubble
from pdcompile.scheduling.placement import Item
from pdcompile.scheduling.registry import register_schedule


def _step_time(
    rules: ZeroBubbleV, num_stages: int, num_microbatches: int, forward_s: float,
    backward_s: float, *, weight_s: float | None = None, chunks: int = 2,
) -> float:  # fmt: skip
    """2M(F + I + W) + the largest of the forms in the module's docstring (p = num_stages / 2
    >= 2; M >= 2p - 1); one rank: 2M(F + I + W). Two stages per rank, whatever `chunks`."""
    f, (i, w) = forward_s, split_parts(backward_s, weight_s)
    p, m = num_stages // 2, num_microbatches
    if p == 1:  # one rank runs the whole V: nothing to wait for
        return 2 * m * (f + i + w)
    fill = max(
        (p - 1) * i,
        max(f, i) + (p - 2) * w,
        (2 * p - 3) * f - (p - 2) * i,
        (2 * p - 2) * f - (p - 1) * i - w,
        2 * (p - 1) * (i - w),
        (2 * p - 2) * f - (2 * p - 1) * w,
        (2 * p - 3) * f + i - (2 * p - 2) * w,
    )
    return 2 * m * (f + i + w) + fill


def _in_flight(
    rules: ZeroBubbleV, replicas: Sequence[int], stage: int, num_microbatches: int, *,
    chunks: int = 2,
) -> int:  # fmt: skip
    """Microbatch-chunks the rank running `stage` holds, its two stages together: 2p."""
    return len(replicas)


@register_schedule("zb-v")
class ZeroBubbleV(VPlacement, PipelineSchedule):
    """ZB-V: two stages per rank in a V, split backward, 1F1B's peak activations."""

    meaning = (
        "synchronous (zero-bubble ZB-V): two stages per rank in a V (rank r runs stages r and "
        "2p - 1 - r); each backward is split into the input gradients, sent back at once, and "
        "the weight gradients, computed later to fill the bubbles; every stage updates once "
        "per step from all microbatches: exactly single-process gradient accumulation."
    )
    items_per_microbatch = 3
    fewest_beyond = -1
    fewest_why = " (what fills its V)"
    closed_forms = ClosedForms(
        step_time=_step_time, bubble=v_bubble(_step_time), in_flight=_in_flight
    )

    def v_rank_order(self, p: int, num_microbatches: int, position: int) -> list[Item]:
        return v_order(p, num_microbatches, position)
