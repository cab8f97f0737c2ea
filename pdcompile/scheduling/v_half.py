"""`v-half`: V-Half (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS'24):
a V of 2p stages on p ranks, split backward, about half of 1F1B's activations.

Placed as `zb-v` (rank r runs stages r and 2p - 1 - r, `chunks=2`). Its building block
(`v_blocks`): the forwards two slots apart down the V and one apart back up, then, `turn` + 1
slots after the last, the I's two slots apart from the top down to the bottom of the V and one
apart from there. From F to I, rank r holds its down stage 6p - 2 + turn - 3r slots and its
up stage 3r + 1 + turn: 6p - 1 + 2 turn together on every rank, a block every 6, so about p
microbatch-chunks (a chunk: one microbatch's activations of one stage of the V, half of a 1F1B
stage's on the same model cut into p stages). Walked peak: 2((p + 2) // 2) chunks per rank, the
paper's (p + 2) // 2 microbatches of a 1F1B stage against 1F1B's p (0.75x at p = 4, 0.5625x at
p = 16); M below (p + 2) // 2 holds 2M. On equal stages (F = I = W) it idles at most the
paper's ~p/2M of a step, less than 1F1B on the same model. Any M >= 1. No closed forms:
a kind's forms start with its step time, and the squeezed warm-up and cool-down have none; the
memory counts are walked off the orders (exactly the counts above), step times simulated.
Synchronous: one update per step, exactly single-process gradient accumulation.
"""

from __future__ import annotations

from pdcompile.scheduling.registry import register_schedule
from pdcompile.scheduling.v_blocks import Block, BlockV


@register_schedule("v-half")
class VHalf(BlockV):
    """V-Half: a V with split backward holding about half of 1F1B's activations."""

    meaning = (
        "synchronous (V-Half, Qi et al. NeurIPS'24): two stages per rank in a V, split "
        "backward, each rank holding at most (p + 2) // 2 microbatches of activations (1f1b: "
        "p); every stage updates once per step from all microbatches: exactly single-process "
        "gradient accumulation."
    )

    @staticmethod
    def block(p: int, turn: int) -> Block:
        """Stage s's F at slot 2s down the V and p - 1 + s back up; its I at 7p - 3 + turn - 2s
        back up and 6p - 2 + turn - s down."""
        forward = tuple(2 * s if s < p else p - 1 + s for s in range(2 * p))
        backward = tuple(
            7 * p - 3 + turn - 2 * s if s >= p else 6 * p - 2 + turn - s for s in range(2 * p)
        )
        return Block(forward, backward)
