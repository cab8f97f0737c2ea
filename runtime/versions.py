"""Weight versions of the streaming schedules as pure functions. Torch-free.

`pipedream`: stage s has `replicas[s]` replicas; minibatch k goes to replica k mod r_s, and the
r_s replicas make one shared update per round of r_s minibatches (docs/runtime.md works an
example). `2bw`: every stage updates once per step of M microbatches, from the gradient computed
on the weights before the previous update.
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


def two_bw_version(num_microbatches: int, microbatch: int, first_step: int = 0) -> int:
    """Updates in the weights microbatch k's forward and backward use under `2bw` (every stage
    alike): it belongs to step t = first_step + k // M, which computes on W(t - 1), the first
    two steps on W(0). `first_step` is the updates made before the stream (re)started.

    >>> [two_bw_version(2, k) for k in range(8)]
    [0, 0, 0, 0, 1, 1, 2, 2]
    """
    if num_microbatches < 1 or microbatch < 0 or first_step < 0:
        raise ScheduleError(
            f"2bw versions need num_microbatches >= 1, microbatch >= 0 and first_step >= 0, "
            f"got {num_microbatches}, {microbatch}, {first_step}"
        )
    return max(0, first_step + microbatch // num_microbatches - 1)


def two_bw_warmup(replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
    """Warm-up forwards of each replica of `stage` under `2bw`: PipeDream's w_s, capped at
    M // r_s, the microbatches a replica holds of every step (r_s divides M). So no forward of
    step t + 2 comes before its update t, and two weight versions suffice: W(t) for step t + 1,
    W(t - 1) for step t. The cap can bind only when M < sum_{t>=s} r_t - 1."""
    return min(warmup(replicas, stage), num_microbatches // replicas[stage])
