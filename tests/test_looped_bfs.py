"""`looped-bfs` against torch's `ScheduleLoopedBFS`: the same orders, item for item.

Torch computes each rank's order in `_calculate_single_rank_operations` from three fields of
the schedule (its local stages, the group size, the microbatch count), so it is called on a
stand-in holding just those: no process group, no stage modules.
"""

from __future__ import annotations

import types

import pytest
from torch.distributed.pipelining.schedules import ScheduleLoopedBFS

from pdcompile.scheduling import Placement, get_schedule


def torch_orders(ranks: int, chunks: int, num_microbatches: int) -> dict[int, list[tuple]]:
    """Torch's `pipeline_order` of `ranks` x `chunks` stages, its idle slots dropped."""
    fake = types.SimpleNamespace(
        _stages=[None] * chunks, pp_group_size=ranks, _n_microbatches=num_microbatches
    )
    orders = {}
    for rank in range(ranks):
        ops = ScheduleLoopedBFS._calculate_single_rank_operations(fake, rank)
        orders[rank] = [
            (a.computation_type.value, a.stage_index, a.microbatch_index) for a in ops if a
        ]
    return orders


@pytest.mark.parametrize(("ranks", "chunks", "m"), [(2, 2, 4), (4, 2, 8), (3, 3, 5), (4, 1, 6)])
def test_its_orders_are_torchs(ranks: int, chunks: int, m: int) -> None:
    rules = get_schedule("looped-bfs")
    stage_ranks = [(rules.chunk_rank(s, ranks, chunks),) for s in range(ranks * chunks)]
    placement = Placement(tuple(stage_ranks), num_microbatches=m)
    ours = {r: list(order) for r, order in rules.rank_orders(placement).items()}
    assert ours == torch_orders(ranks, chunks, m)
