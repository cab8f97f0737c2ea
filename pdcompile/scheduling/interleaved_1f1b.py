"""`interleaved-1f1b`: Megatron's interleaved 1F1B (Narayanan et al., SC'21): v stages per rank.

p ranks run v chunks each (`plan(..., chunks=v)`, default 2): stage i on the rank of stage
i mod p. Each rank runs Megatron's order (`chunks.interleaved_order`): forwards in groups of p
microbatches through its chunks, 2(p - 1 - r) + (v - 1)p warm-up forwards on the rank at
position r, then a forward and a backward alternately, then the last backwards; one update
per step, from every microbatch (synchronous, like `1f1b`). M must be a multiple of p.

Equal stages (F, B per microbatch and stage): a call takes (vM + p - 1)(F + B), a bubble of
(p - 1) / (vM + p - 1) (1F1B's on the same ranks: (p - 1) / (M + p - 1)). The rank at position
r holds at most min(vM, (v - 1)p + 2(p - 1 - r) + 1) microbatch-chunks in flight (each a
chunk's activations). With one stage per rank (v = 1) this is `1f1b`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.chunks import check_round_robin, interleaved_order
from pdcompile.scheduling.closed_forms import ClosedForms, warmup_in_flight
from pdcompile.scheduling.placement import Item, Placement
from pdcompile.scheduling.registry import register_schedule
from pdcompile.scheduling.warmup_orders import WarmupSchedule


def _step_time(
    rules: Interleaved1F1B, num_stages: int, num_microbatches: int, forward_s: float,
    backward_s: float, *, weight_s: float | None = None, chunks: int = 1,
) -> float:  # fmt: skip
    """(vM + p - 1)(F + B) with p = num_stages / v ranks."""
    p = num_stages // chunks
    return (chunks * num_microbatches + p - 1) * (forward_s + backward_s)


def _in_flight(
    rules: Interleaved1F1B, replicas: Sequence[int], stage: int, num_microbatches: int, *,
    chunks: int = 1,
) -> int:  # fmt: skip
    """Microbatch-chunks the rank running `stage` holds at most (all its stages together):
    its warm-up and one forward, at most vM."""
    if chunks == 1:
        return warmup_in_flight(rules, replicas, stage, num_microbatches)
    p = len(replicas) // chunks
    held = rules.megatron_warmup(p, chunks, stage % p) + 1
    return min(held, chunks * num_microbatches)


@register_schedule("interleaved-1f1b")
class Interleaved1F1B(WarmupSchedule):
    """Megatron's interleaved 1F1B: v stages per rank, bubble (p - 1) / (vM + p - 1)."""

    meaning = (
        "synchronous (Megatron's interleaved 1F1B): each rank runs several stages (chunks), "
        "placed round-robin; gradients of all microbatches are accumulated and every stage "
        "updates once per step: exactly single-process gradient accumulation, with a bubble "
        "v times smaller than 1f1b's for v chunks per rank."
    )
    default_chunks = 2
    closed_forms = ClosedForms(step_time=_step_time, in_flight=_in_flight)

    def check_layout(self, ranks: Sequence[Sequence[int]], num_microbatches: int) -> None:
        p, v = check_round_robin(self.name, ranks)
        if v > 1 and num_microbatches % p:
            raise ScheduleError(
                f"{self.name} runs microbatches in groups of the {p} ranks (Megatron's order): "
                f"num_microbatches must be a multiple of {p}, got {num_microbatches}"
            )

    def rank_orders(self, placement: Placement) -> Mapping[int, Sequence[Item]]:
        p, v = check_round_robin(self.name, placement.ranks)
        if v == 1:
            return super().rank_orders(placement)  # 1F1B
        return {
            placement.ranks[r][0]: interleaved_order(
                p, v, placement.total, r, self.megatron_warmup(p, v, r)
            )
            for r in range(p)
        }

    @staticmethod
    def megatron_warmup(p: int, v: int, position: int) -> int:
        """Megatron's warm-up forwards on the rank at `position`: 2(p - 1 - r) + (v - 1)p."""
        return 2 * (p - 1 - position) + (v - 1) * p
