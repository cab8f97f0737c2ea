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

from pdcompile.cluster import Cluster
from pdcompile.cost_model import CostModel
from pdcompile.progress import note
from pdcompile.schedules import PipelineSchedule

log = logging.getLogger(__name__)
TOLERANCE = 1e-12
MAX_PROBES = 15
# Measured costs (2-core CPU, numpy): per numpy call of a round, and per element of the
# searchsorted queries (log N comparisons each); they pick the limits tested per round.
CALL_COST_S = 6e-6
ELEMENT_COST_S = 4e-9


class _Tables:
    """The limit-independent arrays: W_r and the offsets W_r[j] - c_r cut[j], per replica count."""

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
        self.base = self.w - c * cut  # a stage from j meets T up to the last k: w[k] <= base[j] + T
        self.whole = self.w[:, n] - self.w[:, 0]  # one stage on r replicas, cut[0] = 0
        self.calls = len(self.replicas) + self.total  # numpy calls per round
        self.elements = len(self.replicas) * (n + 1) * math.log2(n + 2)  # per limit


def _ends(t: _Tables, limits: np.ndarray) -> np.ndarray:
    """K[s, i, j]: the last end a stage from j on `replicas[i]` meets `limits[s]` at."""
    ends = np.empty((len(limits), len(t.replicas), t.n + 1), dtype=np.int64)
    for i, w in enumerate(t.w):
        ends[:, i] = np.searchsorted(w, t.base[i] + limits[:, None], side="right") - 1
    return ends


def _reach(t: _Tables, best: np.ndarray) -> np.ndarray:
    """reach[u, s]: the longest prefix covered with at most u devices under `limits[s]`, from
    `best` = the running maximum of `_ends` along j."""
    num = best.shape[0]
    reach = np.zeros((t.total + 1, num), dtype=np.int64)
    rows = np.arange(num)[:, None]
    for u in range(1, t.total + 1):
        count = int(np.searchsorted(t.replicas, u, side="right"))  # counts r <= u
        if count == 0:
            continue
        before = reach[u - t.replicas[:count]].T  # (limit, r)
        reached = best[rows, np.arange(count)[None, :], before].max(axis=1)
        reach[u] = np.maximum(reach[u - 1], reached)
        if (reach[u] >= t.n).all():
            reach[u + 1 :] = reach[u]
            break
    return reach


def _fits(t: _Tables, limits: np.ndarray) -> np.ndarray:
    """Whether stages <= each limit cover all n positions on the cluster's devices."""
    best = np.maximum.accumulate(_ends(t, limits), axis=2)
    return _reach(t, best)[-1] >= t.n


def _cover(t: _Tables, limit: float) -> list[tuple[int, int, int]]:
    """Stages (start, end, replicas) of a cover under `limit` on the fewest devices."""
    ends = _ends(t, np.array([limit]))[0]
    best = np.maximum.accumulate(ends, axis=1)
    reach = _reach(t, best[None])[:, 0]
    stages = []
    e = t.n
    while e > 0:
        u = int(np.searchsorted(reach, e, side="left"))  # reach[u] >= e > reach[u - 1]
        for i, r in enumerate(t.replicas[t.replicas <= u]):
            start = int(reach[u - r])
            if best[i, start] >= e:  # some j <= start reaches e: the latest such
                j = int(np.flatnonzero(ends[i, : start + 1] >= e)[-1])
                stages.append((j, e, int(r)))
                e = j
                break
        else:  # pragma: no cover - reach[u] came from one of the counts above
            raise AssertionError("reach table inconsistent")
    return stages[::-1]


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
    `replica_counts` (default: 1 to the devices)."""
    counts = replica_counts or range(1, cluster.num_devices + 1)
    t = _Tables(p, n, cluster, prices, schedule, microbatches, counts)
    total_compute = float(p.compute[n])
    lo = total_compute / cluster.num_devices * (1 - 1e-9)  # no plan beats perfect balance
    hi = float(t.whole.min()) * (1 + TOLERANCE) + 1e-300  # one stage fits
    if lo <= 0 and _fits(t, np.array([0.0]))[0]:
        return _cover(t, 0.0)  # nothing to balance (data sources only)
    start = max((hi - lo) / hi, TOLERANCE)
    while hi - lo > TOLERANCE * hi:
        probes = min(  # a round shrinks the bracket (probes + 1)-fold
            range(1, MAX_PROBES + 1),
            key=lambda s: (CALL_COST_S * t.calls + ELEMENT_COST_S * s * t.elements) / math.log(s + 1),
        )
        limits = np.linspace(lo, hi, probes + 2)[1:-1]
        fits = _fits(t, limits)
        first = int(fits.argmax()) if fits.any() else probes  # feasibility grows with the limit
        hi = float(limits[first]) if first < probes else hi
        lo = float(limits[first - 1]) if first > 0 else lo
        width = max((hi - lo) / hi, TOLERANCE)
        done = math.log(start / width) / math.log(start / TOLERANCE) if start > TOLERANCE else 1
        log.info("bottleneck within %.0e, goal %.0e", width, TOLERANCE,
                 extra={"progress": min(done, 1.0)})  # fmt: skip
        note(f"bottleneck within {width:.0e}, goal {TOLERANCE:.0e}", min(done, 1.0))
    return _cover(t, hi)
