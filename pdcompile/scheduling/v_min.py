"""`v-min`: V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS'24):
a V of 2p stages on p ranks, split backward, about a third of 1F1B's activations.

Placed as `zb-v` (rank r runs stages r and 2p - 1 - r, `chunks=2`). Its building block
(`v_blocks`): the forwards one slot apart down the V and back up, then, `turn` + 1 slots after
the last, the I's one slot apart from the top of the V back down. Rank r holds its down stage
from slot r to slot 4p - 1 + turn - r and its up stage from 2p - 1 - r to 2p + turn + r:
4p + 2 turn slots together on every rank, a block every 6, so about 2p/3 microbatch-chunks (a
chunk: one microbatch's activations of one stage of the V, half of a 1F1B stage's on the same
model cut into p stages). Walked peak: 2((p + 4) // 3) chunks per rank, the paper's
(p + 4) // 3 microbatches of a 1F1B stage against 1F1B's p (0.5x at p = 4, 0.375x at p = 16);
M below (p + 4) // 3 holds 2M. On equal stages (F = I = W) it idles at most the paper's ~2p/3M
of a step, less than 1F1B on the same model. Any M >= 1. No closed forms: a kind's
forms start with its step time, and the squeezed warm-up and cool-down have none; the memory
counts are walked off the orders (exactly the counts above), step times simulated.
Synchronous: one update per step, exactly single-process gradient accumulation.
"""

from __future__ import annotations

from pdcompile.scheduling.registry import register_schedule
from pdcompile.scheduling.v_blocks import Block, BlockV


@register_schedule("v-min")
class VMin(BlockV):
    """V-Min: a V with split backward holding about a third of 1F1B's activations."""

    meaning = (
        "synchronous (V-Min, Qi et al. NeurIPS'24): two stages per rank in a V, split "
        "backward, each rank holding at most (p + 4) // 3 microbatches of activations (1f1b: "
        "p); every stage updates once per step from all microbatches: exactly single-process "
        "gradient accumulation."
    )

    @staticmethod
    def block(p: int, turn: int) -> Block:
        """Stage s's F at slot s, its I at 4p - 1 + turn - s."""
        return Block(tuple(range(2 * p)), tuple(4 * p - 1 + turn - s for s in range(2 * p)))
