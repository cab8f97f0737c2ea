"""`looped-bfs` against torch's `ScheduleLoopedBFS`: the same orders, item for item.

Torch's constructor computes every rank's `pipeline_order` from what it reads of its stages
(the group's size and rank, the stage count and indices), so it runs on stand-ins holding just
those: no process group, no stage modules.
"""

from __future__ import annotations

import types

import pytest
from torch.distributed.pipelining.schedules import ScheduleLoopedBFS

from pdcompile.scheduling import Placement, get_schedule


def stand_in(rank: int, ranks: int, stages: int, index: int) -> types.SimpleNamespace:
    """What torch's constructor reads of a stage."""
    return types.SimpleNamespace(group_size=ranks, group_rank=rank, num_stages=stages,
                                 submod=None, stage_index=index, is_first=index == 0,
                                 is_last=index == stages - 1)  # fmt: skip


def torch_orders(ranks: int, chunks: int, num_microbatches: int) -> dict[int, list[tuple]]:
    """Torch's `pipeline_order` of `ranks` x `chunks` stages round-robin (rank 0's schedule
    object, which computes every rank's), its idle slots dropped."""
    stages = ranks * chunks
    mine = [stand_in(0, ranks, stages, s) for s in range(0, stages, ranks)]
    order = ScheduleLoopedBFS(mine, num_microbatches).pipeline_order
    return {
        rank: [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in ops if a]
        for rank, ops in order.items()
    }


@pytest.mark.parametrize(("ranks", "chunks", "m"), [(2, 2, 4), (4, 2, 8), (3, 3, 5), (4, 1, 6)])
def test_its_orders_are_torchs(ranks: int, chunks: int, m: int) -> None:
    rules = get_schedule("looped-bfs")
    stage_ranks = [(rules.chunk_rank(s, ranks, chunks),) for s in range(ranks * chunks)]
    placement = Placement(tuple(stage_ranks), num_microbatches=m)
    ours = {r: list(order) for r, order in rules.rank_orders(placement).items()}
    assert ours == torch_orders(ranks, chunks, m)
