"""`pipedream`: PipeDream's asynchronous 1F1B with weight stashing (SOSP 2019).

Every microbatch of a `train_step` is a PipeDream minibatch with its own update, and
minibatches stay in flight across calls until `flush()`. Stage s with r_s replicas runs
w_s = (sum_{t>=s} r_t - 1) // r_s warm-up forwards; minibatch k goes to replica k mod r_s, and
the r_s replicas make one shared update per round of r_s minibatches from the average of their
gradients. Forward and backward of minibatch k at stage s use the weights after
v(k, s) = max(0, k // r_s - w_s) updates (weight stashing keeps them); with vertical sync, the
newest version whose updates include only minibatches stage 0's weights for k include.
Clipping is per stage (stages sharing tied weights together). Equal stages, one per rank, in
the steady state: M (F + B) per call, no bubble, w_s + 1 minibatches and w_s stashed versions
in flight at stage s.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.closed_forms import WARMUP_STREAMED
from pdcompile.scheduling.placement import Placement
from pdcompile.scheduling.registry import register_schedule
from pdcompile.scheduling.warmup_orders import WarmupSchedule
from pdcompile.scheduling.weight_policy import WeightPolicy


def version(replicas: Sequence[int], stage: int, minibatch: int) -> int:
    """Updates of `stage` in the weights minibatch k's forward and backward use there:
    v(k, s) = max(0, k // r_s - w_s)."""
    if not 0 <= stage < len(replicas):
        raise ScheduleError(f"stage {stage} does not exist: the plan has {len(replicas)} stages")
    w = PipeDream().warmup(replicas, stage, 1)
    return max(0, minibatch // replicas[stage] - w)


def vertical_version(replicas: Sequence[int], stage: int, minibatch: int) -> int:
    """With vertical sync: the newest version of `stage` whose updates include only
    minibatches that stage 0's weights for k include.

    Stage 0's version v0 includes the minibatches k' < v0 r_0; version n of stage s includes
    k' < n r_s; so n = min(v(k, s), v0 r_0 // r_s).
    """
    included = version(replicas, 0, minibatch) * replicas[0]
    return min(version(replicas, stage, minibatch), included // replicas[stage])


class PipeDreamWeights(WeightPolicy):
    """Weight stashing: an update per round of a stage's replicas, minibatch k on v(k, s)."""

    streaming = True
    update_per_microbatch = True
    vertical_sync = True
    replicates_ties = False  # its copies would update once per round of other replica counts

    def round_size(self, placement: Placement, stage: int) -> int:
        return placement.replicas[stage]

    def weight_version(
        self, placement: Placement, stage: int, microbatch: int, vertical: bool = False
    ) -> int | None:
        return vertical_version(placement.replicas, stage, microbatch) if vertical else None

    def version(self, placement: Placement, stage: int, minibatch: int) -> int:
        return version(placement.replicas, stage, minibatch)

    def clip_group(
        self, placement: Placement, stage: int, linked: frozenset[int]
    ) -> tuple[int, ...]:
        """Per stage (no group), or with the stages tied to it (one norm over their
        gradients, so tied copies stay equal)."""
        ranks = placement.ranks
        return tuple(sorted(r for t in linked for r in ranks[t])) if len(linked) > 1 else ()


@register_schedule("pipedream")
class PipeDream(WarmupSchedule):
    """PipeDream's asynchronous 1F1B: an update per minibatch, weight stashing, no flush."""

    meaning = (
        "asynchronous: every microbatch is a minibatch with its own update; stage s "
        "computes minibatch k on weights v(k, s) updates old (weight stashing keeps forward and "
        "backward on the same version), so later stages see fresher weights than earlier ones: "
        "staleness of up to the pipeline depth, no bubble. Minibatches stay in flight across "
        "train_step calls until flush()."
    )
    weights = PipeDreamWeights()  # one stashed version per minibatch in flight
    closed_forms = WARMUP_STREAMED

    def check(
        self, replicas: Sequence[int], num_microbatches: int, ties: Sequence[Sequence[int]] = ()
    ) -> None:
        super().check(replicas, num_microbatches)
        if any(num_microbatches % r for r in replicas):
            raise ScheduleError(
                f"pipedream updates a stage once per round of its replicas ({list(replicas)}); "
                f"give a number of minibatches that every replica count divides, got "
                f"{num_microbatches}"
            )
        if any(replicas[s] > 1 for tie in ties for s in tie):
            raise ScheduleError(
                "pipedream with a tied tensor on a replicated stage is not supported: its copies "
                "would update once per round of different replica counts; tie stages must have "
                "one replica each"
            )
