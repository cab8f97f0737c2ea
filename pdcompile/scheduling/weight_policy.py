"""A schedule's optional weight policy: how its steps update and version the weights. Torch-free.

The default, `SYNCHRONOUS`, is what every synchronous schedule does: one update per `train_step`
from all its microbatches (each weighted by its share of the batch), on the newest weights,
clipped over every rank; nothing stashed. A streaming kind (`pipedream`, `2bw`) gives its own
`WeightPolicy` subclass as its schedule's `weights`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcompile.scheduling.placement import Placement


class WeightPolicy:
    """The weight rules of a schedule kind (synchronous as given here).

    Attributes:
        streaming: microbatches stay in flight across `train_step` calls (no flush between
            steps); each forward stashes a weight version (`push`) its backward drops (`pop`).
        update_per_microbatch: each microbatch is a minibatch with its own update (its loss is
            not weighted by its share of the batch; replicas average their gradients).
        vertical_sync: accepts `vertical_sync=True` (`weight_version` honours it).
        keeps_previous: an update first keeps a copy of the weights it changes (the next step
            computes on them: 2BW's two versions).
        replicates_ties: a stage holding a copy of a tied tensor may have several replicas.
    """

    streaming: bool = False
    update_per_microbatch: bool = False
    vertical_sync: bool = False
    keeps_previous: bool = False
    replicates_ties: bool = True

    def round_size(self, placement: Placement, stage: int) -> int:
        """Microbatches of `stage` per update (a streaming stage's replicas update together
        after their last backward of each round): the step's."""
        return placement.num_microbatches

    def weight_version(
        self, placement: Placement, stage: int, microbatch: int, vertical: bool = False
    ) -> int | None:
        """Streaming: the updates (counted from the stream's start; below 0: before it, clamped
        at 0 by the caller) in the weights `microbatch` computes on at `stage`, or None for the
        newest weights when its forward runs."""
        return None

    def version(self, placement: Placement, stage: int, minibatch: int) -> int:
        """Updates of `stage` in the weights minibatch `minibatch` runs on
        (`PipelinedModule.version`): synchronous, the steps before its own."""
        return minibatch // placement.num_microbatches

    def clip_group(
        self, placement: Placement, stage: int, linked: frozenset[int]
    ) -> tuple[int, ...]:
        """The ranks whose gradients share one norm when clipping `stage` (`linked`: the stages
        tied to it; `()`: the stage alone). Default: every rank (global clipping)."""
        return placement.world

    def stashed_versions(self, placement: Placement, stage: int, in_flight: int) -> int:
        """Weight copies a replica of `stage` keeps at most besides the live weights, holding
        `in_flight` microbatches at most: none when synchronous; streaming, one per microbatch
        in flight (each may have run its forward after another update)."""
        return in_flight if self.streaming else 0

    def steady_calls(self, placement: Placement, warmups: Sequence[int]) -> int:
        """Streaming: `train_step` calls until one is in the steady state (every replica of
        stage s has had its `warmups[s]` + 1 microbatches before it starts)."""
        steady = max(r * (w + 1) for r, w in zip(placement.replicas, warmups, strict=True))
        return -(-steady // placement.num_microbatches) + 1


SYNCHRONOUS = WeightPolicy()
