"""`zb-h1`: zero-bubble ZB-H1 (Qi et al., ICLR'24): 1F1B with the backward split into I and W.

Each backward is split into I (the gradients of the stage's inputs, sent back at once) and W
(those of its weights, run later to fill a bubble). Stage s runs 1F1B's warm-up w_s, then a
forward and an I alternately, each I followed by the W of the microbatch d_s I's earlier, then
the W's still waiting (`chunks.split_order`), with d_s = max_t w_t - w_s (a straight pipeline:
d_s = s): the first stage runs each W at once, the later ones fill the drain with theirs. So
every stage holds 1F1B's peak in flight, p microbatches (counting one whose W is pending): stage
s holds p - s whose I is pending, 1F1B's count there, and up to s more with only W left.
Synchronous: one update per step from every microbatch.

With `chunks=v` (v stages per rank, stage i on the rank of stage i mod p; v = 2 is torch's
`ScheduleInterleavedZeroBubble`), each rank runs Megatron's interleaved order with split
backwards, (v - 1)p + p - 1 - r warm-up forwards and d = r on the rank at position r, and holds
vp microbatch-chunks (1F1B's peak in bytes when its stages split one rank's share in v).

Equal stages (F, I, W per microbatch and stage; B = I + W), M >= p: a call takes
vM(F + I + W) + (p - 1) max(F, I, F + I - W); F = I = W: a bubble of (p - 1) / (3vM + p - 1),
a third of 1F1B's idle time. `step_time` has the form for every M (v = 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.chunks import check_round_robin, interleaved_order, split_order
from pdcompile.scheduling.closed_forms import ClosedForms, split_parts
from pdcompile.scheduling.placement import Item, Placement
from pdcompile.scheduling.registry import register_schedule
from pdcompile.scheduling.warmup_orders import WarmupSchedule


def _step_time(
    rules: ZeroBubbleH1, num_stages: int, num_microbatches: int, forward_s: float,
    backward_s: float, *, weight_s: float | None = None, chunks: int = 1,
) -> float:  # fmt: skip
    """vM(F + I + W) + (p - 1) max(F, I, F + I - W) for M >= p (p = num_stages / v); one
    stage per rank and M < p: with q = max(M, p), the largest of qF + (M + p - 1)I + MW,
    (M + p - 1)F + qI + MW and (M + p - 1)(F + I) + (q - p + 1)W (which is the first form
    when M >= p)."""
    f, (i, w) = forward_s, split_parts(backward_s, weight_s)
    p, m = num_stages // chunks, num_microbatches
    if chunks > 1:
        return chunks * m * (f + i + w) + (p - 1) * max(f, i, f + i - w)
    q = max(m, p)
    return max(
        q * f + (m + p - 1) * i + m * w,
        (m + p - 1) * f + q * i + m * w,
        (m + p - 1) * (f + i) + (q - p + 1) * w,
    )


def _in_flight(
    rules: ZeroBubbleH1, replicas: Sequence[int], stage: int, num_microbatches: int, *,
    chunks: int = 1,
) -> int:  # fmt: skip
    """1F1B's peak, the deepest warm-up and one forward (at most the replica's microbatches);
    with chunks > 1 the microbatch-chunks of the rank running `stage`, all its stages
    together: vp (at most vM)."""
    if chunks > 1:
        p = len(replicas) // chunks
        return chunks * min(p, num_microbatches)
    deepest = max(rules.warmup(replicas, t, num_microbatches) for t in range(len(replicas)))
    return min(deepest + 1, -(-num_microbatches // replicas[stage]))


def deferred(
    rules: ZeroBubbleH1, replicas: Sequence[int], stage: int, num_microbatches: int
) -> int:
    """Of the microbatches in flight, those a replica of `stage` holds with only W pending:
    its `defer`, at most its microbatches beyond its warm-up and one forward (so that the
    rest, min(its warm-up + 1, its microbatches), have their I pending). `zb-h2`'s too."""
    mine = -(-num_microbatches // replicas[stage])
    held = rules.warmup(replicas, stage, num_microbatches) + 1
    return min(rules.defer(replicas, stage, num_microbatches), max(0, mine - held))


@register_schedule("zb-h1")
class ZeroBubbleH1(WarmupSchedule):
    """ZB-H1: backward split into I and W, W's fill the drain, at 1F1B's peak activations."""

    meaning = (
        "synchronous (zero-bubble ZB-H1): each backward is split into the input gradients, "
        "sent back at once, and the weight gradients, computed later to fill the pipeline's "
        "drain; every stage updates once per step from all microbatches: exactly "
        "single-process gradient accumulation."
    )
    items_per_microbatch = 3
    default_chunks = 1
    auto_chunks = (1, 2)  # 2: what torch's `ScheduleInterleavedZeroBubble` runs
    closed_forms = ClosedForms(step_time=_step_time, in_flight=_in_flight, deferred=deferred)

    def check_layout(self, ranks: Sequence[Sequence[int]], num_microbatches: int) -> None:
        p, v = check_round_robin(self.name, ranks)
        if v > 1 and num_microbatches % p:
            raise ScheduleError(
                f"{self.name} with {v} stages per rank runs microbatches in groups of the {p} "
                f"ranks: num_microbatches must be a multiple of {p}, got {num_microbatches}"
            )

    def defer(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """W's a replica of `stage` leaves waiting: so many that it holds the deepest
        warm-up's microbatches in flight, max_t w_t - w_s."""
        deepest = max(self.warmup(replicas, t, num_microbatches) for t in range(len(replicas)))
        return deepest - self.warmup(replicas, stage, num_microbatches)

    def replica_order(
        self, replicas: Sequence[int], stage: int, num_microbatches: int, mine: Sequence[int]
    ) -> list[tuple[str, int]]:
        w = self.warmup(replicas, stage, num_microbatches)
        return split_order(mine, w, self.defer(replicas, stage, num_microbatches))

    def rank_orders(self, placement: Placement) -> Mapping[int, Sequence[Item]]:
        p, v = check_round_robin(self.name, placement.ranks)
        if v == 1:
            return super().rank_orders(placement)
        return {
            placement.ranks[r][0]: interleaved_order(
                p, v, placement.total, r, (v - 1) * p + p - 1 - r, split=True, defer=r
            )
            for r in range(p)
        }
