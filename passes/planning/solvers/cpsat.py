"""`cpsat`: a CP-SAT model of contiguous stages with replicas, speeds and exact memory limits.

Stages are contiguous runs of one topological order (that of `dynprog`'s best plan, which is the
warm start, via `AddHint`): slot s covers positions [b_s, b_{s+1}) on r_s replicas, slots used from
the front, ranks consecutive. Intervals of a topological order are convex; a DAG-wide convexity
model would need a stage variable per node and cut terms per (node, boundary), too big. The
objective is the bottleneck T under the cost model (`options["cost_model"]`); with booleans
y_{s,r} ("slot s has r replicas") a stage's time is linear once r is fixed. A stage updates every
u_r = E q_r microbatches (`updates_every`, E the largest common factor: M for the synchronous
schedules, with q_r = 1; 1 for pipedream, with q_r = r), so

    q_r A_s + (r - 1) dG_s <= r q_r T,   A_s = compute_s / sigma + transfers on one replica,
                                         dG_s = the whole ring (`ring_limit_s`) / E

Prefix tables over the order are read at b_s through a thermometer z_{s,v} = [v >= b_s]
(table[b_s] = table[n] - sum_v (table[v + 1] - table[v]) z_{s,v}: linear, exact). Speeds: one
compute table per distinct speed, its constraint enforced when the stage holds a device that slow.
Memory is the schedule's `memory_counts` for the layout exactly: a function of the stages from s
on, S - s (S one-hot), of w_s = floor((sum_{t >= s} r_t - 1) / r_s) (one-hot) and of the deepest
warm-up max_t w_t (a thermometer at least every w_t: each stage's constraint holds for every
depth up to it), each encoded only if the schedule's counts depend on it (1f1b: min(w_s + 1, M)
in flight; 2bw: min(w_s, M) + 1; pipedream: w_s + 1 and w_s versions; gpipe: M; zb-h1/zb-h2: also
the microbatches whose W alone is pending, which grow with the deepest warm-up, at all their
activation bytes, as the runtime keeps them), the peak with or without the gradients
(`MemoryCounts.charges`: both must fit). On one order `dynprog` is exact too, except for memory,
where its safe bound can miss plans that fit: that is what `cpsat` adds.

Times are integer ticks, `dynprog`'s bottleneck being 10^6 ticks (fewer if a table would overflow).
Table entries are rounded to the nearest tick, so a stage's model time is within 1.5 ticks of its
true time and an optimal model solution is within 4 ticks of the best plan of the order.
`plan.options`: `bound` (a proven lower bound, seconds, on every plan of the order, rounding
included), `gap` ((predicted - bound) / predicted), `status` (OPTIMAL or FEASIBLE), `tick_s`.
The plan is the better of CP-SAT's and `dynprog`'s under `evaluate`. Hierarchical clusters, models
of more than `max_cells` nodes x devices and graphs with tied tensors under a schedule that does
not replicate ties (`pipedream`: stages holding part of a tie need one replica, which this model
does not say) fall back to `dynprog` (`fallback`, `reason` recorded).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from pdcompile.core.cluster import Cluster
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError
from pdcompile.core.message_buffers import stage_bytes
from pdcompile.passes.planning.cost_model import Pricing
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.solver_kit import SEARCH, make_plan, register_solver
from pdcompile.passes.planning.solvers.dp import Prefix, dp, tie_positions
from pdcompile.passes.planning.solvers.orders import linear_orders

if TYPE_CHECKING:  # imported where a model is built: ortools (and pandas) take 1-2 s to load
    from ortools.sat.python import cp_model

TICKS = 10**6  # dynprog's bottleneck in ticks
MAX_CELLS = 20_000  # nodes x devices
_SLACK = 2.5  # ticks between the model's optimum and the true optimum (see the docstring)
_OPTIONS = ("time_limit_s", "num_workers", "max_cells", "cost_model")
_BASE = (*SEARCH, "cost_model")  # what cpsat hands on to dynprog


class _Model:
    """The CP-SAT model of one order on a flat cluster."""

    def __init__(
        self,
        p: Prefix,
        n: int,
        pricing: Pricing,
        ref: float,
    ) -> None:
        cluster, rules, prices, microbatches = pricing
        d = self.devices = cluster.num_devices
        self.n, self.slots = n, min(n, d)
        self.rules, self.microbatches = rules, microbatches
        self.speed = cluster.speed or (1.0,) * d
        self.classes = sorted(set(self.speed))  # slowest first
        bandwidth = cluster.levels[0].bandwidth
        every = [prices.updates_every(rules, r, microbatches) for r in range(1, d + 1)]
        common = math.gcd(*every)  # E, in the ring table; q_r = u_r / E in the constraints
        self.paces = [u // common for u in every]  # q_r
        raw = {
            "compute": [[float(c) / sigma for c in p.compute] for sigma in self.classes],
            "cut": [prices.transfer_s(float(c), bandwidth, 1) for c in p.cut],
            "ring": [prices.ring_limit_s(float(g), bandwidth) / common for g in p.grad],
        }
        largest = max(raw["compute"][0][n], max(raw["cut"]), raw["ring"][n], 1e-300)
        factor = max(d * d, *(r * q for r, q in enumerate(self.paces, 1)))  # of T, at most
        self.scale = min(TICKS / ref if ref > 0 else TICKS / largest,
                         min(2**40, 2**60 // factor) / (3 * largest))  # fmt: skip
        tick = self._tick
        self.compute = [[tick(x) for x in row] for row in raw["compute"]]
        self.cut, self.ring = [tick(x) for x in raw["cut"]], [tick(x) for x in raw["ring"]]
        self.weights = [int(x) for x in p.weights]
        self.params = [int(x) for x in p.params]
        self.activations = [int(x) for x in p.activations]
        self.grads = [int(x) for x in p.grad]
        self.edges = [int(x) for x in p.edges]  # bytes of the edges across each boundary
        from ortools.sat.python import cp_model

        self.model = cp_model.CpModel()
        self._lookups: dict[tuple[str, int, int], Any] = {}
        self._build(cluster.memory)

    def _tick(self, seconds: float) -> int:
        return int(round(seconds * self.scale))

    def _at(self, name: str, row: int, s: int) -> Any:
        """Table `name` (row `row` for compute) at boundary b_s: a constant or a variable."""
        table = self.compute[row] if name == "compute" else getattr(self, name)
        if s == 0 or s == self.slots:
            return table[self.b[s]]
        key = (name, row, s)
        if key not in self._lookups:  # table[b_s], telescoped over the thermometer z[s]
            var = self.model.new_int_var(min(table), max(table), f"{name}{row}_{s}")
            steps = [table[v + 1] - table[v] for v in range(self.n)]
            terms = [step * z for step, z in zip(steps, self.z[s], strict=True) if step]
            self.model.add(var == table[self.n] - sum(terms))
            self._lookups[key] = var
        return self._lookups[key]

    def _diff(self, name: str, s: int, row: int = 0) -> Any:
        return self._at(name, row, s + 1) - self._at(name, row, s)

    def _build(self, memory: float | None) -> None:
        model, n, d, slots = self.model, self.n, self.devices, self.slots
        self.b = [0] + [model.new_int_var(0, n, f"b{s}") for s in range(1, slots)] + [n]
        # z[s][v]: position v is at or after boundary b_s (a thermometer; linear lookups)
        self.z = [[]] + [[model.new_bool_var(f"z{s}_{v}") for v in range(n)]
                         for s in range(1, slots)]  # fmt: skip
        for s in range(1, slots):
            model.add(self.b[s] == n - sum(self.z[s]))
            for v in range(n - 1):
                model.add_implication(self.z[s][v], self.z[s][v + 1])
                if s + 1 < slots:
                    model.add_implication(self.z[s + 1][v], self.z[s][v])
        self.a = [model.new_bool_var(f"a{s}") for s in range(slots)]
        model.add(self.a[0] == 1)
        for s in range(slots):
            model.add(self.b[s + 1] >= self.b[s] + 1).only_enforce_if(self.a[s])
            model.add(self.b[s + 1] == self.b[s]).only_enforce_if(~self.a[s])
            if s:
                model.add_implication(self.a[s], self.a[s - 1])
        self.y = [[model.new_bool_var(f"y{s}_{r}") for r in range(1, d + 1)] for s in range(slots)]
        self.reps = [sum(r * y for r, y in enumerate(row, 1)) for row in self.y]
        for s in range(slots):
            model.add(sum(self.y[s]) == self.a[s])
        model.add(sum(self.reps) <= d)
        high = self.compute[0][n] + max(self.cut) + self.ring[n] + 1
        self.time = model.new_int_var(0, high, "T")
        # redundant, for the bound: every stage's work fits in r_s * T, and sum r_s <= d
        fastest = len(self.classes) - 1
        model.add(sum(self._at("cut", 0, s) for s in range(slots)) + self.compute[fastest][n]
                  <= d * self.time)  # fmt: skip
        for s in range(slots):
            self._stage_time(s)
            if memory is not None:
                self._stage_memory(s, min(int(math.floor(memory)), 2**62))  # in int64
        model.minimize(self.time)

    def _speed_literals(self, s: int) -> list[Any]:
        """Per speed class, slowest first: a literal true if stage s holds a device that slow
        (None for the fastest class: its constraint always holds)."""
        model = self.model
        first = sum(self.reps[:s])
        marks = [model.new_bool_var(f"h{s}_{q}") for q in range(len(self.classes) - 1)]
        for i, speed in enumerate(self.speed):
            q = self.classes.index(speed)
            if q == len(self.classes) - 1:
                continue
            inside, left = model.new_bool_var(f"in{s}_{i}"), model.new_bool_var(f"l{s}_{i}")
            model.add(first >= i + 1).only_enforce_if([~inside, left])
            model.add(first + self.reps[s] <= i).only_enforce_if([~inside, ~left])
            model.add_implication(inside, marks[q])
        return [*marks, None]

    def _stage_time(self, s: int) -> None:
        model, t = self.model, self.time
        ring = self._diff("ring", s)
        for q, mark in enumerate(self._speed_literals(s)):
            work = self._diff("compute", s, q) + self._at("cut", 0, s)
            for r, pace in enumerate(self.paces, 1):
                when = [self.y[s][r - 1]] + ([mark] if mark is not None else [])
                model.add(pace * work + (r - 1) * ring <= r * pace * t).only_enforce_if(when)

    def _memory_counts(self) -> None:
        """`memory_counts` per (stages from here - 1, warm-up w, deepest warm-up), and whether
        the schedule's counts depend on the stages from here (then S, the stages used, is
        one-hot), on w (one-hot per stage) and on the deepest warm-up of the pipeline (then it
        is a thermometer at least every stage's w): probed a size beyond this model's, with a
        count of microbatches that caps none, so the model has one shape at every size."""
        model, rules, m = self.model, self.rules, self.microbatches
        d, slots = self.devices, self.slots
        room = max(m, slots + 1, d + 1)
        probe = [[rules.memory_counts(k, w, room, d) for w in range(d + 1)]
                 for k in range(1, slots + 2)]  # fmt: skip
        self.by_stages = any(row != probe[0] for row in probe)
        self.by_warmup = any(x != row[0] for row in probe for x in row)
        self.by_deepest = rules.memory_counts(1, 0, room, 0) != probe[0][0]
        deepest = range(d) if self.by_deepest else [d - 1]
        self.table = [[[rules.memory_counts(k, w, m, x) for x in deepest] for w in range(d)]
                      for k in range(1, (slots if self.by_stages else 1) + 1)]  # fmt: skip
        if self.by_stages:
            self.count = [model.new_bool_var(f"S{k}") for k in range(1, self.slots + 1)]
            model.add_exactly_one(self.count)
            model.add(sum(k * c for k, c in enumerate(self.count, 1)) == sum(self.a))
        if self.by_deepest:  # deep[x - 1]: the deepest warm-up is x or more
            self.deep = [model.new_bool_var(f"deep{x}") for x in range(1, d)]
            for low, high in pairwise(self.deep):
                model.add_implication(high, low)

    def _warmup_marks(self, s: int) -> list[Any]:
        """One-hot w_s = floor((devices from s on - 1) / r_s), for a used slot (none otherwise)."""
        model, d = self.model, self.devices
        marks = [model.new_bool_var(f"w{s}_{w}") for w in range(d)]
        model.add(sum(marks) == self.a[s])
        warm = sum(w * x for w, x in enumerate(marks))
        after = sum(self.reps[s:])
        for r in range(1, d + 1):
            model.add(r * warm <= after - 1).only_enforce_if(self.y[s][r - 1])
            model.add(after - 1 <= r * warm + r - 1).only_enforce_if(self.y[s][r - 1])
        return marks

    def _stage_memory(self, s: int, memory: int) -> None:
        """Stage s fits `memory` under the counts of its stages from here, warm-up and every
        deepest warm-up up to the pipeline's (the thermometer `deep`, at least s's warm-up)."""
        weights, params = self._diff("weights", s), self._diff("params", s)
        acts, grads = self._diff("activations", s), self._diff("grads", s)
        messages = self._message_buffers(s)
        if s == 0:
            self._memory_counts()
        marks = self._warmup_marks(s) if self.by_warmup or self.by_deepest else []
        if self.by_deepest and marks:
            self.model.add(sum(self.deep) >= sum(w * x for w, x in enumerate(marks)))
        for used in range(s + 1, self.slots + 1) if self.by_stages else [s + 1]:
            when = [self.count[used - 1]] if self.by_stages else []
            for w in range(self.devices) if marks else [0]:
                row = self.table[used - s - 1 if self.by_stages else 0][w]
                for x, counts in enumerate(row):
                    if x and row[x] == row[x - 1]:
                        continue  # the same constraint, already enforced from a shallower one
                    deeper = [self.deep[x - 1]] if x else []
                    # a pending W at all its activations (the runtime keeps nearly all)
                    for usage in counts.charges(weights, grads, params, acts, acts):
                        self.model.add(usage + messages <= memory).only_enforce_if(
                            when + marks[w : w + 1] + deeper
                        )

    def _message_buffers(self, s: int) -> Any:
        """Stage s's message buffers, bounded by the edges across its two boundaries."""
        return stage_bytes(self._at("edges", 0, s), self._at("edges", 0, s + 1))

    def hint(self, bounds: list[int], replicas: list[int]) -> None:
        """Warm start from a plan: stage s is positions bounds[s]..bounds[s + 1] on replicas[s]."""
        model, used = self.model, len(replicas)
        ends = [*bounds[1:], *([self.n] * (self.slots - used))]
        for s in range(1, self.slots):
            model.add_hint(self.b[s], ends[s - 1])
            for v, z in enumerate(self.z[s]):
                model.add_hint(z, v >= ends[s - 1])
        first, value = 0, 0
        for s in range(self.slots):
            r = replicas[s] if s < used else 0
            model.add_hint(self.a[s], s < used)
            for k, y in enumerate(self.y[s], 1):
                model.add_hint(y, k == r)
            if r:
                j, k = bounds[s], bounds[s + 1]
                q = self.classes.index(min(self.speed[first : first + r]))
                work = self.compute[q][k] - self.compute[q][j] + self.cut[j]
                ring = self.ring[k] - self.ring[j]
                pace = self.paces[r - 1]
                value = max(value, -(-(pace * work + (r - 1) * ring) // (r * pace)))
            first += r
        model.add_hint(self.time, value)

    def solution(self, solver: cp_model.CpSolver) -> list[tuple[int, int, int]]:
        """(start, end, replicas) per used slot."""
        ends = [solver.value(b) if not isinstance(b, int) else b for b in self.b]
        stages = []
        for s in range(self.slots):
            if solver.boolean_value(self.a[s]):
                r = next(k for k, y in enumerate(self.y[s], 1) if solver.boolean_value(y))
                stages.append((ends[s], ends[s + 1], r))
        return stages


def _check_options(options: dict[str, Any]) -> tuple[float, int, int]:
    unknown = set(options) - {*_BASE, *_OPTIONS}
    if unknown:
        raise PartitionError(
            f"cpsat: unknown options {sorted(unknown)}; cpsat takes {', '.join(_OPTIONS)}"
        )
    limit = float(options.get("time_limit_s", 10.0))
    workers = int(options.get("num_workers", 1))
    cells = int(options.get("max_cells", MAX_CELLS))
    if not limit > 0 or workers < 1:
        raise PartitionError(
            f"cpsat: time_limit_s must be > 0 and num_workers >= 1, got {limit} and {workers}"
        )
    return limit, workers, cells


def _as_cpsat(plan: Plan, options: dict[str, Any], **extra: Any) -> Plan:
    """`plan` (from dynprog) labelled as cpsat's, with cpsat's options and `extra` recorded."""
    own = {k: v for k, v in options.items() if k not in _BASE}
    return plan.with_(solver="cpsat", options={**own, **plan.options, **extra})


@register_solver("cpsat")
def cpsat(cost_graph: CostGraph, cluster: Cluster, options: dict[str, Any]) -> Plan:
    """CP-SAT over one linear order: replicas, speeds, exact memory; warm-started by dynprog."""
    limit, workers, cells = _check_options(options)
    pricing = Pricing.of(cluster, options)
    base_options = {k: options[k] for k in _BASE if k in options}
    try:
        base: Plan | None = dp(cost_graph, cluster, base_options)
    except PartitionError:
        base = None  # dynprog's safe memory bound found nothing; the exact model may
    orders = linear_orders(cost_graph)
    name = base.options["order"] if base is not None else "graph"
    order = orders[name]
    why = _fallback_reason(cost_graph, cluster, pricing, order, cells)
    if why is not None:
        if base is None:
            raise PartitionError(f"{why}, and dynprog finds no plan that fits memory")
        return _as_cpsat(base, options, fallback="dynprog", reason=why + "; used dynprog")
    cp = _model_of(cost_graph, pricing, order, base, options.get("replica_counts"))
    from ortools.sat.python import cp_model

    solver, status = _solve(cp, limit, workers)
    if status == cp_model.INFEASIBLE:
        raise PartitionError(
            f"no placement fits: device memory is {cluster.memory:.4g} B, and no contiguous plan "
            f"of the {name} order fits it (proven by cpsat); use more devices, a larger memory, "
            "schedule 1f1b, or a smaller microbatch"
        )
    found = None
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        groups = [(order[j:k], r) for j, k, r in cp.solution(solver)]
        found = make_plan(cost_graph, cluster, groups, options, "cpsat")
    if found is None and base is None:
        raise PartitionError(
            f"cpsat: no plan found within time_limit_s={limit} (status "
            f"{solver.status_name(status)}); raise the limit"
        )
    if base is not None and (found is None or base.predicted_time < found.predicted_time):
        found = _as_cpsat(base, options)  # CP-SAT's plan lost to rounding, or none in time
    assert found is not None
    return _with_bound(found, name, cp, solver, status)


def _fallback_reason(
    cost_graph: CostGraph, cluster: Cluster, pricing: Pricing, order: list[str], cells: int
) -> str | None:
    """Why this model cannot plan `order` on `cluster` (then dynprog's plan is used), or None:
    a hierarchical cluster, more than `cells` nodes x devices, or tied tensors under a schedule
    that does not replicate ties."""
    n, d, rules = len(order), cluster.num_devices, pricing.rules
    if not cluster.is_flat:
        return f"cpsat: the cluster has {len(cluster.levels)} levels; cpsat handles flat clusters"
    if n * d > max(cells, 0):
        return f"cpsat: {n} nodes x {d} devices = {n * d} > max_cells={cells}; model too large"
    if not rules.replicates_ties and tie_positions(cost_graph, order):
        return f"cpsat: under {rules.name}, stages holding part of a tied tensor need one replica"
    return None


def _model_of(
    cost_graph: CostGraph,
    pricing: Pricing,
    order: list[str],
    base: Plan | None,
    allowed: Collection[int] | None,
) -> _Model:
    """The model of `order`, scaled to dynprog's plan `base` (else one device's time), without
    the replica counts outside `allowed` (those the schedule refuses at this M; None: all), and
    warm-started from `base`."""
    cluster, n = pricing.cluster, len(order)
    p = Prefix(cost_graph, order)
    ref = float(p.compute[n]) / max(cluster.speed or [1.0])  # one device, no communication
    ref = base.predicted_time if base is not None else ref
    cp = _Model(p, n, pricing, ref)
    for row in cp.y if allowed else ():
        for r, chosen in enumerate(row, 1):
            if r not in allowed:
                cp.model.add(chosen == 0)
    if base is not None:
        sizes = [len(s.nodes) for s in base.stages]
        cp.hint([sum(sizes[:i]) for i in range(len(sizes) + 1)], [s.replicas for s in base.stages])
    return cp


def _solve(cp: _Model, limit: float, workers: int) -> tuple[cp_model.CpSolver, int]:
    """Run CP-SAT on `cp` for at most `limit` seconds on `workers` workers: the solver and the
    status."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = limit
    solver.parameters.num_workers = workers
    solver.parameters.cp_model_probing_level = 0  # probing costs 10x on these models, finds little
    return solver, solver.solve(cp.model)


def _with_bound(found: Plan, name: str, cp: _Model, solver: cp_model.CpSolver, status: int) -> Plan:
    """`found` with the order, CP-SAT's proven bound (seconds, less the rounding slack), the gap,
    the status and the tick recorded in its options."""
    from ortools.sat.python import cp_model

    bound = max(0.0, (solver.best_objective_bound - _SLACK) / cp.scale)
    gap = (found.predicted_time - bound) / found.predicted_time if found.predicted_time else 0.0
    return found.with_(
        options={
            **found.options, "order": name, "bound": bound, "gap": max(gap, 0.0),
            "status": "OPTIMAL" if status == cp_model.OPTIMAL else "FEASIBLE",
            "tick_s": 1 / cp.scale,
        },
    )  # fmt: skip
