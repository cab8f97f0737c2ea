"""PipeDream's weight versions as pure functions of (minibatch, stage). Torch-free.

Stage s has `replicas[s]` replicas; minibatch k goes to replica k mod r_s, and the r_s replicas
make one shared update per round of r_s minibatches (docs/runtime.md works an example).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcompile.errors import ScheduleError


def _check(replicas: Sequence[int], stage: int) -> None:
    if not replicas or any(r < 1 for r in replicas):
        raise ScheduleError(f"replica counts must be >= 1 per stage, got {list(replicas)}")
    if not 0 <= stage < len(replicas):
        raise ScheduleError(f"stage {stage} does not exist: the plan has {len(replicas)} stages")


def warmup(replicas: Sequence[int], stage: int) -> int:
    """Warm-up forwards of each replica of `stage` (PipeDream's rule):
    w_s = (sum_{t>=s} r_t - 1) // r_s."""
    _check(replicas, stage)
    return (sum(replicas[stage:]) - 1) // replicas[stage]


def version(replicas: Sequence[int], stage: int, minibatch: int) -> int:
    """Updates of `stage` applied to the weights minibatch k's forward and backward use there:
    v(k, s) = max(0, k // r_s - w_s)."""
    w = warmup(replicas, stage)
    return max(0, minibatch // replicas[stage] - w)


def vertical_version(replicas: Sequence[int], stage: int, minibatch: int) -> int:
    """With vertical sync: the newest version of `stage` whose updates include only minibatches
    that stage 0's weights for k include.

    Stage 0's version v0 includes the minibatches k' < v0 r_0; version n of stage s includes
    k' < n r_s; so n = min(v(k, s), v0 r_0 // r_s).
    """
    included = version(replicas, 0, minibatch) * replicas[0]
    return min(version(replicas, stage, minibatch), included // replicas[stage])
