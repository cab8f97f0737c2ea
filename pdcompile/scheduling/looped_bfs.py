"""`looped-bfs`: looped breadth-first (Lamy-Poirier, "Breadth-First Pipeline Parallelism",
2023), as torch's `ScheduleLoopedBFS`.

Stages sit round-robin on the ranks (stage i on rank i mod p, `chunks=2` by default). Each
rank runs every one of its microbatches through its first stage, then through its next, and
so on; then the fused backwards from its last stage down, each stage's microbatches in
reverse order (torch's `_calculate_single_rank_operations`, item for item: GPipe on each of
a rank's stages in turn). Any microbatch count, any layout (replicas, stages stacked on a
rank). Every microbatch of every stage of a rank is in flight at once (v M microbatch-chunks
per rank): walked off its orders, no closed forms. Synchronous: one update per step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdcompile.scheduling.action_kinds import B, F
from pdcompile.scheduling.base import PipelineSchedule
from pdcompile.scheduling.placement import Item, Placement
from pdcompile.scheduling.registry import register_schedule


def breadth_first(placement: Placement, rank: int) -> list[Item]:
    """`rank`'s order: its stages' forwards, stage by stage and microbatch by microbatch, then
    their backwards from its last stage down, the microbatches in reverse."""
    stages = placement.stages_of(rank)
    forwards = [(F, s, k) for s in stages for k in placement.mine(rank, s)]
    backwards = [(B, s, k) for s in reversed(stages) for k in reversed(placement.mine(rank, s))]
    return forwards + backwards


@register_schedule("looped-bfs")
class LoopedBFS(PipelineSchedule):
    """Looped breadth-first: every microbatch through a rank's stage before its next stage."""

    meaning = (
        "synchronous (looped breadth-first, torch's ScheduleLoopedBFS): each rank runs all "
        "microbatches through its first stage, then its next, then the backwards from its last "
        "stage down; every stage updates once per step from all microbatches: exactly "
        "single-process gradient accumulation, holding every microbatch's activations."
    )
    default_chunks = 2

    def rank_orders(self, placement: Placement) -> Mapping[int, Sequence[Item]]:
        return {rank: breadth_first(placement, rank) for rank in placement.world}
