"""`dynprog`'s fast path on a flat homogeneous cluster without a memory limit: bisection on the
bottleneck T with a reach DP over device counts. Exact; O(N R log N + D R) per limit tested.

On a flat cluster a stage's time depends only on its positions [j, k) of the order and its
replica count r, linearly in the prefix sums of compute C and gradient bytes G and in the bytes
cut[j] crossing into it:

    time_r(j, k) = a_r (C[k] - C[j]) + b_r (G[k] - G[j]) + c_r cut[j]

(the cost model's `stage_time`, `allreduce_s` and `transfer_s` at one second, byte and byte),
nondecreasing in k. For a limit T, K_r[j], the last end a stage from j on r replicas meets T
at, is one `searchsorted` on W_r = a_r C + b_r G for all j. The prefixes that stages <= T cover
with at most u devices are exactly those up to some reach[u]: from a cover of a longer prefix,
dropping the stages past a shorter end and cutting the last one short only lowers stage times
and frees devices. So

    reach[0] = 0,  reach[u] = max(reach[u - 1], max_r max_{j <= reach[u - r]} K_r[j])

with a running maximum of K_r over j, and T fits iff reach[D] >= N. A cover is read back from
the same tables: the fewest devices u with reach[u] >= N, a replica count r and a start
j <= reach[u - r] whose stage reaches the end, and so on from j.

R is the number of replica counts a stage may have (all D, or `options["replica_counts"]`),
and any all-reduce pace is allowed (each r's `updates_every` is read off the schedule). Where
hierarchical clusters keep `bisection.py`'s residue DP, this replaces it on flat ones: NASNet's
1,251 nodes on 16 devices in tens of milliseconds, a 20,000-node chain on 4 in well under a
second (it took 39 rounds of 20,000 prefix steps there).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdcompile.core.cluster import Cluster
from pdcompile.core.progress import note
from pdcompile.passes.planning.cost_model import CostModel
from pdcompile.scheduling import PipelineSchedule

log = logging.getLogger(__name__)
TOLERANCE = 1e-12


class _Tables:
    """The limit-independent arrays, per replica count r: W_r, the offsets W_r[j] - c_r cut[j]
    and their running maximum over j (a stage from some j <= J meets T up to the last k with
    W_r[k] <= max_{j <= J} offset_r[j] + T, so the running maximum of the ends is one
    `searchsorted` of sorted queries)."""

    def __init__(
        self,
        p: Any,
        n: int,
        cluster: Cluster,
        prices: CostModel,
        schedule: PipelineSchedule,
        microbatches: int,
        replica_counts: Sequence[int],
    ) -> None:
        self.n, self.total = n, cluster.num_devices
        bandwidth = cluster.levels[-1].bandwidth
        self.replicas = np.array(sorted(replica_counts), dtype=np.int64)
        every = np.array(
            [prices.updates_every(schedule, int(r), microbatches) for r in self.replicas]
        )
        rs = self.replicas[:, None].astype(float)
        a = prices.stage_time(1.0, rs, 0.0, 0.0)
        b = prices.allreduce_s(1.0, rs, bandwidth, every[:, None])
        c = prices.transfer_s(1.0, bandwidth, rs)
        compute, grads, cut = p.compute[: n + 1], p.grad[: n + 1], p.cut[: n + 1]
        self.w = a * compute + b * grads  # (R, N + 1), nondecreasing along each row
        self.base = self.w - c * cut
        self.running = np.maximum.accumulate(self.base, axis=1)
        self.whole = self.w[:, n] - self.w[:, 0]  # one stage on r replicas, cut[0] = 0
        # the counts r <= u, per u; and where row r starts in a flattened (R, N + 1) table
        self.usable = np.searchsorted(self.replicas, np.arange(self.total + 1), side="right")
        self.rows = np.arange(len(self.replicas))[:, None] * (n + 1)


class _Probe:
    """The tables at one limit: best[i, J], the last end a stage from some j <= J on
    `replicas[i]` meets the limit at (-1: none), and reach[u], the longest prefix stages
    within the limit cover with at most u devices."""

    def __init__(self, limit: float, best: np.ndarray, reach: np.ndarray) -> None:
        self.limit, self.best, self.reach = limit, best, reach

    def fits(self, n: int) -> bool:
        return bool(self.reach[-1] >= n)


def _probe(t: _Tables, limit: float, below: _Probe | None = None, above: _Probe | None = None
           ) -> _Probe:  # fmt: skip
    """The tables at `limit`. Both grow with the limit, so between a probe `below` it and one
    `above` it only the entries where those two differ are computed: the ends by a vectorised
    bisection between theirs, the reach values in order of u."""
    if below is None or above is None:
        best = np.empty((len(t.replicas), t.n + 1), dtype=np.int64)
        for i, w in enumerate(t.w):
            best[i] = np.searchsorted(w, t.running[i] + limit, side="right") - 1
        reach = np.zeros(t.total + 1, dtype=np.int64)
        steps: Any = range(1, t.total + 1)
    else:
        best = below.best.copy()
        flat = best.ravel()
        at = np.flatnonzero(flat != above.best.ravel())
        if len(at):
            # the last k in [low, high] with w[i, k] <= running[i, j] + limit; low meets it
            low, high = flat[at], above.best.ravel()[at]
            row = at // (t.n + 1)
            query = t.running.ravel()[at] + limit
            w = t.w.ravel()
            while True:
                open_ = low < high
                if not open_.any():
                    break
                mid = (low + high + 1) // 2
                ok = w[row * (t.n + 1) + np.maximum(mid, 0)] <= query
                low = np.where(open_ & ok, mid, low)
                high = np.where(open_ & ~ok, mid - 1, high)
            flat[at] = low
        reach = below.reach.copy()
        steps = np.flatnonzero(below.reach != above.reach)
    table = best.ravel()
    for u in steps:
        count = t.usable[u]
        if count == 0:
            continue
        back = reach[u - t.replicas[:count]] + t.rows[:count, 0]
        reach[u] = max(reach[u - 1], table[back].max())
    return _Probe(limit, best, np.minimum(reach, t.n))


def _cover(t: _Tables, probe: _Probe) -> tuple[list[tuple[int, int, int]], float]:
    """Stages (start, end, replicas) of a cover under `limit` on the fewest devices, from its
    probe, and the least limit it meets (its bottleneck)."""
    limit, reach, best = probe.limit, probe.reach, probe.best
    stages = []
    bottleneck = 0.0
    e = t.n
    while e > 0:
        u = int(np.searchsorted(reach, e, side="left"))  # reach[u] >= e > reach[u - 1]
        # reach[u] came from one of these counts: some j <= its start reaches e (the latest)
        i, r, start = next(
            (i, r, int(reach[u - r]))
            for i, r in enumerate(t.replicas[: t.usable[u]])
            if best[i, int(reach[u - r])] >= e
        )
        ends = np.searchsorted(t.w[i], t.base[i, : start + 1] + limit, side="right") - 1
        j = int(np.flatnonzero(ends >= e)[-1])
        stages.append((j, e, int(r)))
        bottleneck = max(bottleneck, float(t.w[i, e] - t.base[i, j]))
        e = j
    return stages[::-1], bottleneck


def solve_reach(
    p: Any,
    n: int,
    cluster: Cluster,
    prices: CostModel,
    schedule: PipelineSchedule,
    microbatches: int,
    replica_counts: Sequence[int] | None = None,
) -> list[tuple[int, int, int]]:
    """Stages (start, end, replicas) with the least bottleneck (to `TOLERANCE` relative) on a
    flat homogeneous `cluster`, stages priced by `prices`, replica counts from
    `replica_counts` (default: 1 to the devices).

    The search keeps the best cover found and a limit that fails, halving the bracket; a
    cover that fits lowers the upper end to its own bottleneck. Each probe computes only what
    differs between the tables at the two ends (`_probe`), so once the bracket is narrow a probe
    costs little whatever the devices.
    """
    counts = replica_counts or range(1, cluster.num_devices + 1)
    t = _Tables(p, n, cluster, prices, schedule, microbatches, counts)
    total_compute = float(p.compute[n])
    lo = total_compute / cluster.num_devices * (1 - 1e-9)  # no plan beats perfect balance
    hi = float(t.whole.min()) * (1 + TOLERANCE) + 1e-300  # one stage fits
    below = _probe(t, max(lo, 0.0))
    if below.fits(n):  # nothing to balance (data sources only), or lo was not below
        return _cover(t, below)[0]
    above = _probe(t, hi)
    stages, bound = _cover(t, above)
    start = max((bound - lo) / bound, TOLERANCE)
    while bound - lo > TOLERANCE * bound:
        probe = _probe(t, (lo + bound) / 2, below, above)
        if probe.fits(n):
            stages, value = _cover(t, probe)
            above, bound = probe, min(probe.limit, value)
        else:
            below, lo = probe, probe.limit
        width = max((bound - lo) / bound, TOLERANCE)
        done = math.log(start / width) / math.log(start / TOLERANCE) if start > TOLERANCE else 1
        log.info("bottleneck within %.0e, goal %.0e", width, TOLERANCE,
                 extra={"progress": min(done, 1.0)})  # fmt: skip
        note(f"bottleneck within {width:.0e}, goal {TOLERANCE:.0e}", min(done, 1.0))
    return stages
