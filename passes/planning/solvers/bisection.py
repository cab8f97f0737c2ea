"""`dynprog`'s fast path: bisection on the bottleneck with a fewest-devices DP (homogeneous,
no memory).

For a bottleneck value T, the DP finds the fewest devices that cover a prefix of the order with
every stage's time <= T; T is found by bisection (to `TOLERANCE` relative). On a homogeneous
cluster without a memory limit a stage's time depends on its first rank m only through
m mod P, P the devices in one group of the second-to-outermost level (one server of
`8@300GB/s,128@25GB/s`; P = 1 on a flat cluster): the level it spans and the link into it are
fixed by that residue, the previous stage's span level and the replica count. So the state is
(prefix end k, residue, span level of the last stage) and its value the fewest devices m; two
states that agree on (k, residue, level) have the same futures, and fewer devices is better.

A stage on ranks [m, m + r) either stays within its group (r <= P - m mod P: at most P
transitions per state, enumerated, and only starts j with compute(j, k) <= P T can pass) or
crosses a group boundary, when its span and its incoming link are the outermost level whatever
the state: the fewest replicas meeting T then has a closed form in (j, k), and because "the
smallest end >= e with a given residue" is monotone in e, one minimum over all (j, residue)
gives every residue's best end at once. Cost per bisection step: O(N^2 P + N W P^2 L) for
N nodes, W starts within P T, L levels.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from pdcompile.core.cluster import Cluster
from pdcompile.core.progress import note
from pdcompile.passes.planning.cost_model import CostModel
from pdcompile.scheduling import PipelineSchedule

log = logging.getLogger(__name__)
TOLERANCE = 1e-12
MAX_PROBES = 15
# Measured costs of one DP round (2-core CPU, numpy): per node (numpy calls) and per element of
# the arrays one probe adds; they pick the probes per round (more probes, fewer rounds).
NODE_COST_S = 85e-6
ELEMENT_COST_S = 11e-9


Pace = tuple[int, int]  # (k, E): a stage with r replicas updates every E r^k microbatches


def ring_pace(
    prices: CostModel, schedule: PipelineSchedule, total: int, microbatches: int
) -> Pace | None:
    """(k, E) with `updates_every` = E r^k for every replica count r up to `total`: k = 0 for
    a fixed count (the synchronous schedules), k = 1 for one update per round of the replicas.
    None for any other pace: the crossing stages' closed forms need one of these two."""
    every = [prices.updates_every(schedule, r, microbatches) for r in range(1, total + 1)]
    if len(set(every)) == 1:
        return 0, every[0]
    if all(e == every[0] * r for r, e in enumerate(every, 1)):
        return 1, every[0]
    return None


class _Geometry:
    """The T-independent tables: in-group transitions and the bandwidths they run at."""

    def __init__(self, cluster: Cluster, prices: CostModel, pace: Pace) -> None:
        self.total = cluster.num_devices
        self.levels = len(cluster.levels)
        self.top = self.levels - 1
        self.group = self.total // cluster.levels[-1].count  # P
        bandwidth = [lv.bandwidth for lv in cluster.levels]
        self.top_bandwidth = bandwidth[-1]
        self.prices, self.power = prices, pace[0]
        # seconds per gradient byte of a crossing stage's whole ring, per microbatch: spread
        # over E microbatches, a ring E times as fast
        self.ring_per_byte = prices.ring_limit_s(1.0, self.top_bandwidth * pace[1])
        rows = []  # (residue, previous level, replicas, span, link level)
        for res in range(self.group):
            boundary = self.top if res == 0 else cluster.level_of(res - 1, res)
            for r in range(1, self.group - res + 1):
                span = cluster.level_of(res, res + r - 1)
                for prev in range(self.levels):
                    rows.append((res, prev, r, span, max(prev, boundary, span)))
        table = np.array(rows)
        target = ((table[:, 0] + table[:, 2]) % self.group) * self.levels + table[:, 3]
        order = np.argsort(target, kind="stable")  # transitions grouped by the state they reach
        self.res, self.prev, self.replicas, span, link = table[order].T
        self.targets, self.first = np.unique(target[order], return_index=True)
        self.bounds = np.append(self.first, len(order))
        # time = compute * a + grads * b + cut * c, per transition (the cost model is linear)
        every = pace[1] * self.replicas ** pace[0]
        ring = np.array([bandwidth[s] for s in span])
        self.a = prices.stage_time(1.0, self.replicas, 0.0, 0.0)
        self.b = prices.allreduce_s(1.0, self.replicas, ring, every)
        self.c = prices.transfer_s(1.0, np.array([bandwidth[t] for t in link]), self.replicas)
        self.residues = np.arange(self.group)


def _crossing_range(
    geo: _Geometry, work: np.ndarray, grads: np.ndarray, limits: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None]:
    """Replicas r >= 2 meeting each limit for stages spanning the top level: [lo, hi], shape
    (starts, limits); lo is inf where none does, hi None or inf where unbounded.

    `work` = compute + transfers on one replica (top level), `grads` the stage's gradient
    bytes. With R the whole ring per microbatch, time(r) = work / r + R (r - 1) / r / r^k.
    """
    limit = limits[None, :]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if geo.power == 1:
            # time(r) = (work + b) / r - b / r^2, decreasing for r >= 2
            b = (geo.ring_per_byte * grads)[:, None]
            a = work[:, None] + b
            root = (a + np.sqrt(np.maximum(a * a - 4 * limit * b, 0.0))) / (2 * limit)
            lo = np.where(a / 2 - b / 4 <= limit, 2.0, np.maximum(np.ceil(root - 1e-12), 2.0))
            return lo, None
        # time(r) = c + (work - c) / r: falls towards c if work > c, else rises towards c
        c = geo.ring_per_byte * grads
        cc = c[:, None]
        # limit <= c: no replica count will do; a tiny divisor makes lo exceed any cluster
        lo = np.maximum(np.ceil((work - c)[:, None] / np.maximum(limit - cc, 1e-300) - 1e-12), 2.0)
        rising = work <= c
        if not rising.any():
            return lo, None
        hi = np.where(limit >= cc, np.inf, np.floor((c - work)[:, None] / (cc - limit) + 1e-12))
        lo = np.where(rising[:, None], np.where(hi >= 2, 2.0, np.inf), lo)
        return lo, np.where(rising[:, None], hi, np.inf)


def _fewest(
    p, n: int, geo: _Geometry, limits: np.ndarray, track: bool = False
) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Fewest devices covering all n nodes with every stage <= limit, for each of `limits`.

    With `track` (one limit) also the stages (start, end, replicas) of such a cover.
    """
    return _FewestDevices(p, n, geo, limits, track).solve()


class _FewestDevices:
    """`_fewest`'s DP, filled prefix by prefix: `fewest[k, residue * L + level, s]` is the fewest
    devices covering the first k nodes with the last stage ending at that residue and span level,
    every stage within `limits[s]`; with `track`, `parent[k, state]` is that last stage (start,
    previous state, replicas)."""

    def __init__(self, p, n: int, geo: _Geometry, limits: np.ndarray, track: bool) -> None:
        self.p, self.n, self.geo, self.limits, self.track = p, n, geo, limits, track
        P, L, S = geo.group, geo.levels, len(limits)
        self.fewest = np.full((n + 1, P * L, S), np.inf)  # [k, residue * L + level, limit]
        self.fewest[0, geo.top] = 0.0
        # crossing stages from prefix j: table[j, x] = min over residues of the first end
        # reachable with x replicas, max(start + x, first rank past the group + 1), x <= P + 1
        self.table = np.full((n + 1, P + 2, S), np.inf)
        self.by_res = np.full((n + 1, P, S), np.inf)  # fewest over levels
        self.pick_res = np.zeros((n + 1, P + 2), dtype=np.int64)
        self.pick_level = np.zeros((n + 1, P), dtype=np.int64)
        self.parent = np.zeros((n + 1, P * L, 3), dtype=np.int64)  # (start, previous, replicas)
        self.xs = np.arange(P + 2)[None, :, None]
        self.offsets = (np.arange(n + 1) * (P + 2) * S)[:, None] + np.arange(S)  # table.take
        self.residues = geo.residues[:, None]
        self.src = geo.res * L + geo.prev
        self.cut2 = geo.prices.transfer_s(p.cut, geo.top_bandwidth, 1)
        self.widest = P * float(limits.max()) * (1 + 1e-9)

    def solve(self) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """Fill every prefix; returns the fewest devices per limit and, with `track`, the
        stages of a cover for the first limit."""
        geo, n = self.geo, self.n
        self._finish(0)
        for k in range(1, n + 1):
            row = np.full((geo.group * geo.levels, len(self.limits)), np.inf)
            self._within_groups(k, row)
            self._across_groups(k, row)
            self.fewest[k] = row
            self._finish(k)
        used = self.fewest[n].min(axis=0)
        stages = self._stages() if self.track and np.isfinite(used[0]) else []
        return used, stages

    def _finish(self, k: int) -> None:
        """Prefix k is final: its fewest per residue and its row of the crossing table."""
        P, L, S = self.geo.group, self.geo.levels, len(self.limits)
        grid = self.fewest[k].reshape(P, L, S)
        start = self.by_res[k] = grid.min(axis=1)  # (residue, limit)
        past = start - self.residues + P + 1
        options = np.maximum(start[:, None, :] + self.xs, past[:, None, :])  # (residue, x, limit)
        self.table[k] = options.min(axis=0)
        if self.track:
            self.pick_res[k] = options[:, :, 0].argmin(axis=0)
            self.pick_level[k] = grid[:, :, 0].argmin(axis=1)

    def _within_groups(self, k: int, row: np.ndarray) -> None:
        """Stages [j, k) within one group into `row`: only starts with compute <= P * limit can
        meet it."""
        p, geo, src = self.p, self.geo, self.src
        j0 = int(np.searchsorted(p.compute, p.compute[k] - self.widest, "left"))
        js = np.arange(j0, k)
        if not len(js):
            return
        time = (
            np.outer(geo.a, p.compute[k] - p.compute[js])
            + np.outer(geo.b, p.grad[k] - p.grad[js])
            + np.outer(geo.c, p.cut[js])
        )[:, :, None]
        before = self.fewest[js][:, src, :].transpose(1, 0, 2)  # (transition, start, limit)
        ends = np.where(time <= self.limits, before + geo.replicas[:, None, None], np.inf)
        best = ends.min(axis=1)  # (transition, limit)
        row[geo.targets] = np.minimum.reduceat(best, geo.first, axis=0)
        if self.track:
            for target, a, b in zip(geo.targets, geo.bounds[:-1], geo.bounds[1:], strict=True):
                t = a + int(best[a:b, 0].argmin())
                w = int(ends[t, :, 0].argmin())
                self.parent[k, target] = (js[w], src[t], geo.replicas[t])

    def _across_groups(self, k: int, row: np.ndarray) -> None:
        """Stages [j, k) crossing a group boundary into `row`: span and incoming link at the top
        level."""
        geo, L, P = self.geo, self.geo.levels, self.geo.group
        ends, owner, owner_res, lo = self._crossing_ends(k)
        ends = np.where(ends <= geo.total, ends, np.inf)
        states = geo.residues * L + geo.top
        better = ends < row[states]
        row[states] = np.where(better, ends, row[states])
        if self.track and better[:, 0].any():
            for res in np.flatnonzero(better[:, 0]):
                j0, r0 = int(owner[res, 0]), int(owner_res[res, 0])
                if r0 < 0:
                    r0 = int(self.pick_res[j0, min(int(lo[j0, 0]), P + 1)])
                replicas = ends[res, 0] - self.by_res[j0, r0, 0]
                self.parent[k, states[res]] = (j0, r0 * L + self.pick_level[j0, r0], replicas)

    def _crossing_ends(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The least end of a crossing stage into k per (residue, limit), with its start, its
        start's residue (-1: the one the table picked) and the fewest replicas per (start,
        limit)."""
        p, geo, P, S = self.p, self.geo, self.geo.group, len(self.limits)
        work = p.compute[k] - p.compute[:k] + self.cut2[:k]
        lo, hi = _crossing_range(geo, work, p.grad[k] - p.grad[:k], self.limits)
        x = np.minimum(lo, P + 1).astype(np.int64)
        first = self.table.take(self.offsets[:k] + x * S) + np.maximum(lo - P - 1, 0.0)
        # (start, limit): the least end, whatever its residue
        capped = None if hi is None else np.flatnonzero(np.isfinite(hi).any(axis=1))
        if capped is not None and len(capped):
            first[capped] = np.inf  # handled one by one below
        j = first.argmin(axis=0)
        least = first[j, np.arange(S)]
        # the smallest end >= e with a given residue grows with e: one minimum serves them all
        with np.errstate(invalid="ignore"):
            ends = np.where(np.isfinite(least), least + (self.residues - least) % P, np.inf)
        owner = np.broadcast_to(j, (P, S))
        owner_res = np.full((P, S), -1)  # -1: the residue the table picked
        if capped is not None and len(capped):
            ends, owner, owner_res = _capped_ends(geo, self.by_res, lo, hi, capped, ends, owner)
        return ends, owner, owner_res, lo

    def _stages(self) -> list[tuple[int, int, int]]:
        """The stages (start, end, replicas) of a cover for the first limit, from `parent`."""
        state, k = int(self.fewest[self.n, :, 0].argmin()), self.n
        stages = []
        while k > 0:
            j, prev, r = (int(v) for v in self.parent[k, state])
            stages.append((j, k, r))
            k, state = j, prev
        return stages[::-1]


def _capped_ends(
    geo: _Geometry,
    by_res: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    rows: np.ndarray,
    ends: np.ndarray,
    owner: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Crossing stages whose replica count is capped (time rising with r): every (start,
    residue) pair separately. Returns the improved ends and their (start, residue) per residue."""
    P = geo.group
    start = by_res[rows]  # (row, residue, limit)
    with np.errstate(invalid="ignore"):
        least = np.maximum(start + lo[rows][:, None, :], start - geo.residues[:, None] + P + 1)
        e = least[:, :, None, :] + (geo.residues[None, None, :, None] - least[:, :, None, :]) % P
        fits = (e - start[:, :, None, :] <= hi[rows][:, None, None, :]) & np.isfinite(e)
    e = np.where(fits, e, np.inf).reshape(-1, P, e.shape[-1])  # (row * residue, new residue, limit)
    pick = e.argmin(axis=0)
    value = np.take_along_axis(e, pick[None], axis=0)[0]
    use = value < ends
    owner_res = np.where(use, pick % P, -1)
    return np.where(use, value, ends), np.where(use, rows[pick // P], owner), owner_res


def _narrow(p, n: int, geo: _Geometry, lo: float, hi: float, tolerance: float) -> float:
    """Shrink [lo, hi] (lo fails, hi fits) to `tolerance` relative; returns the new hi.

    Each round tests several evenly spaced limits at once (one vectorised DP) and keeps the
    bracket between the largest that fails and the smallest that fits. More probes per round
    mean fewer rounds (fewer numpy calls) but more work per call; the count minimises the
    estimated time per factor of bracket shrink. Each round logs how far the bracket is from
    `tolerance` (`progress`, 0 to 1: the share of the way in log scale; `pdcompile.core.progress`
    shows it).
    """
    if lo <= 0 and _fewest(p, n, geo, np.array([0.0]))[0][0] <= geo.total:
        return 0.0  # nothing to balance (no compute: data sources only); halving hi underflows
    start = max((hi - lo) / hi, tolerance)
    while hi - lo > tolerance * hi:
        ks = np.arange(1, n + 1)
        starts = ks - np.searchsorted(p.compute, p.compute[ks] - geo.group * hi * (1 + 1e-9))
        elements = n * n / 2 + len(geo.replicas) * float(starts.sum())
        probes = min(  # a round shrinks the bracket (probes + 1)-fold
            range(1, MAX_PROBES + 1),
            key=lambda s: (NODE_COST_S * n + ELEMENT_COST_S * s * elements) / math.log(s + 1),
        )
        limits = np.linspace(lo, hi, probes + 2)[1:-1]
        fits = _fewest(p, n, geo, limits)[0] <= geo.total
        first = int(fits.argmax()) if fits.any() else probes  # feasibility grows with the limit
        hi = float(limits[first]) if first < probes else hi
        lo = float(limits[first - 1]) if first > 0 else lo
        width = max((hi - lo) / hi, tolerance)
        done = math.log(start / width) / math.log(start / tolerance) if start > tolerance else 1
        log.info("bottleneck within %.0e, goal %.0e", width, tolerance,
                 extra={"progress": min(done, 1.0)})  # fmt: skip
        note(f"bottleneck within {width:.0e}, goal {tolerance:.0e}", min(done, 1.0))
    return hi


def solve_bisection(
    p: Any, n: int, cluster: Cluster, prices: CostModel, pace: Pace
) -> list[tuple[int, int, int]]:
    """Stages (start, end, replicas) with the least bottleneck, to `TOLERANCE` relative, stages
    priced by `prices` with the all-reduce pace `pace` (`ring_pace`)."""
    total_compute = float(p.compute[n])
    total = cluster.num_devices
    lo = total_compute / total * (1 - 1e-9)  # no plan beats perfect balance
    everyone = prices.data_parallel_time(  # one stage on every device: a plan that always fits
        total_compute, float(p.grad[n]), total, cluster.levels[-1].bandwidth,
        pace[1] * total ** pace[0],
    )  # fmt: skip
    hi = min(total_compute, everyone)
    hi = hi * (1 + TOLERANCE) + 1e-300  # one stage on one device, or on all of them, fits
    if not cluster.is_flat:
        # A plan for the same devices all linked at the slowest level fits here too; its
        # bottleneck (to 1e-2, cheaply: one transition within a group) caps the window of starts
        # the in-group stages must try.
        slowest = Cluster([(cluster.num_devices, min(lv.bandwidth for lv in cluster.levels))])
        hi = _narrow(p, n, _Geometry(slowest, prices, pace), lo, hi, 1e-2)
    geo = _Geometry(cluster, prices, pace)
    hi = _narrow(p, n, geo, lo, hi, TOLERANCE)
    return _fewest(p, n, geo, np.array([hi]), track=True)[1]
