"""`v-half`: V-Half (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS'24):
a V of 2p stages on p ranks, split backward, about half of 1F1B's activations.

Placed as `zb-v` (rank r runs stages r and 2p - 1 - r, `chunks=2`). Each rank holds at most
2((p + 2) // 2) microbatch-chunks (a chunk: one microbatch's activations of one stage of the
V, half of a 1F1B stage's on the same model cut into p stages), i.e. the paper's (p + 2) // 2
microbatches of a 1F1B stage, where 1F1B's first rank holds p: about 1/2. Orders from
`capped_v.capped_v_orders` under that cap. Any M >= 1; 2p stages in a V. No closed forms:
memory counts are walked off the orders, step times simulated. Synchronous: one update per
step, exactly single-process gradient accumulation.
"""

from __future__ import annotations

from pdcompile.scheduling.capped_v import CappedV
from pdcompile.scheduling.registry import register_schedule


@register_schedule("v-half")
class VHalf(CappedV):
    """V-Half: a V with split backward holding about half of 1F1B's activations."""

    meaning = (
        "synchronous (V-Half, Qi et al. NeurIPS'24): two stages per rank in a V, split "
        "backward, each rank holding at most (p + 2) // 2 microbatches of activations (1f1b: "
        "p); every stage updates once per step from all microbatches: exactly single-process "
        "gradient accumulation."
    )

    def cap(self, p: int) -> int:
        """2((p + 2) // 2) microbatch-chunks: (p + 2) // 2 microbatches of a 1F1B stage."""
        return 2 * ((p + 2) // 2)
