"""The schedule simulator: a plan's action lists executed on modelled time. Torch-free.

`simulate` builds the per-rank actions the runtime walks (`build_schedule`, with the plan's tie
groups) and runs them on an event heap: compute takes the plan's seconds, a message travels from
its `send` at the bandwidth of the link it uses (shared fairly with the transfers on that link at
the same time) plus the level's latency, a `recv` waits for its message, collectives wait for
their whole group, and the runtime's own work (packing messages, accumulating gradients, weight
copies, optimizer steps: `action_costs`) takes what the cluster's `RuntimeCosts` say. Every
`train_step` ends with the last stage's ranks sending the loss to every other rank, which waits
for it before its next call; under the streaming
schedules (`pipedream`, `2bw`) it walks the endless stream in calls of `num_microbatches`
microbatches, as `DistributedPipeline.train_step` does. docs/simulator.md has the model.

Example:
    >>> sim = pdcompile.simulate(plan, schedule="gpipe", num_microbatches=8)
    >>> sim.time_per_step, sim.bubble_fraction, sim.peak_memory
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdcompile.cluster import Cluster
from pdcompile.errors import PartitionError, ScheduleError
from pdcompile.plans import Plan, check_schedule
from pdcompile.runtime.action_costs import LOSS_BYTES, send_s, stage_costs, tie_costs
from pdcompile.runtime.actions import Action, Schedule
from pdcompile.runtime.schedules import STREAMING, build_schedule
from pdcompile.runtime.simulated_weights import SimulatedWeights
from pdcompile.runtime.timeline import Event, to_chrome_trace
from pdcompile.runtime.versions import two_bw_warmup, warmup

__all__ = ["Simulation", "simulate"]

COMPUTE = ("F", "B")


@dataclass(frozen=True)
class Simulation:
    """What a simulated run did and cost.

    `timeline`: every action of every rank (seconds from 0); `time_per_step`: seconds per
    `train_step` (synchronous schedules: one step's span; streaming ones: the last,
    steady-state call); `bubble_fraction[rank]`: the share of that span the rank spends
    outside `F` and `B`; `memory[rank]`: (time, bytes in use) after each change;
    `peak_memory[rank]`: its maximum.
    """

    plan: Plan
    schedule: Schedule
    timeline: list[Event]
    time_per_step: float
    bubble_fraction: list[float]
    peak_memory: list[int]
    memory: list[list[tuple[float, int]]]

    def to_chrome_trace(self, path: str | Path | None = None) -> dict[str, Any]:
        """The timeline as Chrome trace-event JSON (opens in Perfetto), written to `path`."""
        return to_chrome_trace(self.timeline, path)

    def plot(self, path: str | Path, title: str | None = None) -> None:
        """Draw the timeline as a Gantt chart (one row per rank) to `path`."""
        from pdcompile.gantt import plot_timelines

        default = (
            f"simulated {self.plan.schedule}, {self.plan.num_stages} stages, "
            f"{self.plan.num_microbatches} microbatches"
        )
        plot_timelines([(title or default, self.timeline)], path)


def simulate(
    plan: Plan,
    *,
    schedule: str | None = None,
    num_microbatches: int | None = None,
    cluster: Cluster | None = None,
) -> Simulation:
    """Simulate one `train_step` of `plan` (for `pipedream` and `2bw`, enough calls to reach
    their steady state) under `schedule` with `num_microbatches` on `cluster` (defaults: the
    plan's).

    A stage's `forward_s`/`backward_s` are taken per microbatch (plan at the microbatch size).
    Tie groups (`plan.ties`) add their all-reduces before each update of their stages.

    Raises:
        PartitionError: the plan has no per-stage byte counts (not scored by this version's
            `pdcompile.evaluate`), the cluster has too few devices for its ranks, or a tie
            group names stages the plan does not have.
        ScheduleError: the schedule cannot be built (e.g. `2bw` with fewer microbatches than
            stages) or deadlocks.
    """
    kind = check_schedule(schedule or plan.schedule)
    m = num_microbatches or plan.num_microbatches
    _check(plan, cluster or plan.cluster)
    plan = _on(plan, cluster or plan.cluster).with_(schedule=kind, num_microbatches=m)
    ranks = [s.ranks for s in plan.stages]
    edges = {(src, s.index): size > 0 for s in plan.stages for src, size in s.recv_bytes}
    ties = [stages for stages, _ in plan.ties]
    if kind not in STREAMING:
        engine = _Engine(plan, build_schedule(kind, ranks, edges, m, ties))
        engine.run_call(math.inf)
        return engine.result(dict.fromkeys(engine.release, 0.0), engine.release)
    replicas = [s.replicas for s in plan.stages]
    calls = streaming_calls(kind, replicas, m)
    deepest = max(_warmup(kind, replicas, s, m) for s in range(len(replicas)))
    lookahead = math.lcm(*replicas) * (deepest + 1) * max(replicas)  # as Pipeline._lookahead
    steps = calls + -(-lookahead // m)
    engine = _Engine(plan, build_schedule(kind, ranks, edges, m, ties, num_steps=steps))
    start = engine.release
    for call in range(1, calls + 1):
        start = engine.release
        engine.run_call(call * m)
    return engine.result(start, engine.release)


def streaming_calls(kind: str, replicas: Sequence[int], num_microbatches: int) -> int:
    """`train_step` calls of a streaming schedule until one is steady: every replica of stage s
    has had w_s + 1 microbatches before it starts (its cut is then in the one-forward-one-
    backward phase); `2bw` one more, as its first two steps share the first weights (the
    second call copies them less often than the later ones)."""
    steady = max(
        r * (_warmup(kind, replicas, s, num_microbatches) + 1) for s, r in enumerate(replicas)
    )
    return -(-steady // num_microbatches) + (2 if kind == "2bw" else 1)


def _warmup(kind: str, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
    if kind == "2bw":
        return two_bw_warmup(replicas, stage, num_microbatches)
    return warmup(replicas, stage)


def _check(plan: Plan, cluster: Cluster) -> None:
    if not any(s.recv_bytes or s.weight_bytes or s.activation_bytes for s in plan.stages):
        raise PartitionError(
            "the plan has no per-stage byte counts (recv_bytes, activation_bytes, weight_bytes: "
            "written by an older pdcompile or never scored); re-score it with "
            "pdcompile.evaluate(plan, cost_graph) or re-plan with `pdcompile plan`"
        )
    for stages, _ in plan.ties:
        if len(set(stages)) < 2 or not all(0 <= s < plan.num_stages for s in stages):
            raise PartitionError(
                f"tie group {list(stages)} must name at least two of the plan's "
                f"{plan.num_stages} stages; re-score the plan with pdcompile.evaluate"
            )
    used = max(r for s in plan.stages for r in s.ranks)
    if used >= cluster.num_devices:
        raise PartitionError(
            f"the plan uses ranks up to {used} but cluster {cluster} has {cluster.num_devices} "
            "devices; simulate on a cluster with at least as many"
        )


def _on(plan: Plan, cluster: Cluster) -> Plan:
    """`plan` on `cluster`: stage times rescaled where its devices' speeds differ."""
    stages = []
    for s in plan.stages:
        factor = plan.cluster.device_speed(s.ranks) / cluster.device_speed(s.ranks)
        stages.append(replace(s, forward_s=s.forward_s * factor, backward_s=s.backward_s * factor))
    return plan.with_(stages=tuple(stages), cluster=cluster)


class _Link:
    """One direction of a link, shared fairly by the transfers on it (processor sharing, in
    virtual time: each active transfer has been served `virtual` bytes since it started at
    `tag - bytes`, so they finish in order of `tag`)."""

    __slots__ = ("bandwidth", "flows", "updated", "version", "virtual")

    def __init__(self, bandwidth: float) -> None:
        self.bandwidth = bandwidth
        self.virtual = 0.0
        self.updated = 0.0
        self.version = 0
        self.flows: list[tuple[float, int, tuple]] = []  # (tag, sequence, message)

    def advance(self, now: float) -> None:
        if self.flows:
            self.virtual += (now - self.updated) * self.bandwidth / len(self.flows)
        self.updated = now

    def next_completion(self, now: float) -> float:
        return now + max(0.0, self.flows[0][0] - self.virtual) * len(self.flows) / self.bandwidth


# heap entries: (time, sequence, code, what, version)
RESUME, COMPLETE, TRANSFER, DELIVER = range(4)  # a rank; a link; a message enters it; arrives


class _Engine:
    """Runs every rank's actions on an event heap; `run_call(bound)` runs until every rank is
    done, blocked, or at its first action that needs a forward minibatch >= `bound`."""

    def __init__(self, plan: Plan, schedule: Schedule) -> None:
        self.plan, self.schedule = plan, schedule
        cluster = plan.cluster
        self.actions = schedule.actions
        self.stage = {r: s.index for s in plan.stages for r in s.ranks}
        self.seconds = {(s.index, "F"): s.forward_s for s in plan.stages}
        self.seconds |= {(s.index, "B"): s.backward_s for s in plan.stages}
        self.bytes = {(src, s.index): size for s in plan.stages for src, size in s.recv_bytes}
        self.costs = stage_costs(plan, cluster)
        self.ties = tie_costs(plan, cluster)
        self.send_s = {pair: send_s(cluster, size) for pair, size in self.bytes.items()}
        self.recv_s = cluster.runtime.message_s
        self.loss_send_s = send_s(cluster, LOSS_BYTES)
        # devices per group of the level below each level (1 below the innermost)
        self.below = [
            math.prod(lv.count for lv in cluster.levels[:k]) for k in range(len(cluster.levels))
        ]
        self.links: dict[tuple[int, int, int], _Link] = {}  # (level, source group, destination)
        self.routes: dict[tuple[int, int], tuple[int, int, int]] = {}  # rank pair -> link
        self.latency: dict[tuple[int, int], float] = {}  # rank pair -> seconds per message
        self.position = dict.fromkeys(self.actions, 0)
        self.clock = dict.fromkeys(self.actions, 0.0)  # when each rank last stopped
        self.last_compute: dict[int, str] = {}  # "F" or "B": what each rank computed last
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self.sequence = 0
        self.arrived: dict[tuple, float] = {}
        self.waiting: dict[tuple, tuple[int, float]] = {}  # message -> (rank, since)
        self.gathering: dict[tuple, list[tuple[int, float]]] = {}  # collective -> arrivals
        self.events: list[Event] = []
        self.release = dict.fromkeys(self.actions, 0.0)  # when each rank starts the next call
        self.bound = math.inf
        # memory: weights, activations in flight, weight copies
        by_stage = {s.index: s for s in plan.stages}
        self.kept = {r: by_stage[s].activation_bytes for r, s in self.stage.items()}
        self.weights = {
            r: SimulatedWeights(plan.schedule, plan.num_microbatches, self.costs[s],
                                by_stage[s].param_bytes)
            for r, s in self.stage.items()
        }  # fmt: skip
        self.used = {r: by_stage[s].weight_bytes for r, s in self.stage.items()}
        self.memory = {r: [(0.0, self.used[r])] for r in self.actions}

    # -- the event loop ---------------------------------------------------------------------

    def _push(self, time: float, code: int, what: Any, version: int = 0) -> None:
        self.sequence += 1
        heapq.heappush(self.heap, (time, self.sequence, code, what, version))

    def run_call(self, bound: float) -> None:
        """Run every rank from its release until nothing can move; then the loss messages
        set the next releases."""
        self.bound = bound
        self.waiting.clear()
        self.gathering.clear()
        before = dict(self.position)
        for rank in self.actions:
            self._push(self.release[rank], RESUME, rank)
        while self.heap:
            time, _, code, what, version = heapq.heappop(self.heap)
            if code == RESUME:
                self._resume(what, time)
            elif code == TRANSFER:
                self._transfer(*what, time)
            elif code == DELIVER:
                self._deliver(what, time)
            elif self.links[what].version == version:
                self._complete(what, time)
        if bound == math.inf and any(self.position[r] < len(a) for r, a in self.actions.items()):
            self._stuck("deadlock")
        if bound < math.inf and self.position == before:
            self._stuck(f"no rank can move towards minibatch {bound}")
        self.release = self._loss_messages()

    def _loss_messages(self) -> dict[int, float]:
        """When each rank starts the next call: the last stage's ranks post the loss to every
        other rank, which waits for it (`DistributedPipeline._loss`)."""
        sources = self.plan.stages[-1].ranks
        posted = {s: self.clock[s] + (len(self.actions) - 1) * self.loss_send_s for s in sources}
        release = {}
        for rank in self.actions:
            t = posted.get(rank, self.clock[rank])
            for s in sources:
                if s != rank:
                    self._link(s, rank)
                    t = max(t, posted[s] + self.latency[(s, rank)]) + self.recv_s
            release[rank] = t
        return release

    def _stuck(self, why: str) -> None:
        stuck = {r: p for r, p in self.position.items() if p < len(self.actions[r])}
        raise ScheduleError(
            f"simulated {self.schedule.kind} schedule stops: {why}; ranks wait at "
            f"{ {r: str(self.actions[r][p]) for r, p in stuck.items()} }\n"
            f"{self.schedule.grid(stuck)}"
        )

    def _resume(self, rank: int, now: float) -> None:
        """Run `rank`'s actions from `now` until one takes time or it has to wait."""
        actions, stage, position, bound = (
            self.actions[rank],
            self.stage[rank],
            self.position,
            self.bound,
        )
        while position[rank] < len(actions):
            a = actions[position[rank]]
            kind = a.kind
            if a.microbatch >= bound and (
                kind in ("F", "push") or (kind in ("send", "recv") and a.stream == "act")
            ):
                break  # the next call gives this minibatch
            if kind in COMPUTE:
                end = now + self.seconds[(stage, kind)]
                weights = self.weights[rank]
                end += weights.forward() if kind == "F" else weights.backward(a.microbatch)
                if kind == "F" and self.last_compute.get(rank) == "B":
                    end += self.costs[stage].reload_s  # the backward pushed the weights out
                self.last_compute[rank] = kind
                self._record(rank, a, now, end)
                if kind == "F":  # activations are kept from a forward to the end of its backward
                    self._use(rank, now, self.kept[rank])
                else:
                    self._use(rank, end, -self.kept[rank])
                self._push(end, RESUME, rank)
                return
            if kind == "recv":
                message = (a.peer, rank, *a.key)
                arrival = self.arrived.pop(message, None)
                if arrival is None:
                    self.waiting[message] = (rank, now)
                    break
                # a message sent in an earlier call may still travel at its end
                end = max(now, arrival) + self.recv_s
            elif a.is_collective:
                if not self._gather(rank, a, now):
                    break
                return
            elif kind == "send":
                end = now + self.send_s[a.key[2:]]
                if end > now:  # packed and posted: the transfer starts after
                    self._push(end, TRANSFER, (rank, a))
                else:
                    self._transfer(rank, a, now)
            else:
                end = now + self._version(rank, a, now) if kind in ("push", "pop", "step") else now
            self._record(rank, a, now, end)
            if end > now:
                self._push(end, RESUME, rank)
                return
        self.clock[rank] = now

    def _record(self, rank: int, a: Action, start: float, end: float) -> None:
        self.events.append(Event(rank, a.kind, a.stage, a.microbatch, start, end, a.peer))
        self.position[rank] += 1

    # -- messages ---------------------------------------------------------------------------

    def _transfer(self, rank: int, a: Action, now: float) -> None:
        """A sent message enters its link (or, without bytes, only waits the latency)."""
        message = (rank, a.peer, *a.key)
        size = self.bytes[a.key[2:]]
        if size <= 0:
            self._arrive(message, now)
            return
        key = self._link(rank, a.peer)
        link = self.links[key]
        link.advance(now)
        self.sequence += 1
        heapq.heappush(link.flows, (link.virtual + size, self.sequence, message))
        self._reschedule(key, link, now)

    def _link(self, src: int, dst: int) -> tuple[int, int, int]:
        """Transfers between the same two groups of the slowest level the ranks span share one
        link per direction (two ranks of one innermost group: a link of their own)."""
        key = self.routes.get((src, dst))
        if key is None:
            level = self.plan.cluster.level_of(min(src, dst), max(src, dst))
            size = self.below[level]
            key = self.routes[(src, dst)] = (level, src // size, dst // size)
            self.latency[(src, dst)] = self.plan.cluster.levels[level].latency
            self.links.setdefault(key, _Link(self.plan.cluster.levels[level].bandwidth))
        return key

    def _reschedule(self, key: tuple[int, int, int], link: _Link, now: float) -> None:
        """The link's next completion (earlier ones scheduled are stale from now on)."""
        link.version += 1
        if link.flows:
            self._push(link.next_completion(now), COMPLETE, key, link.version)

    def _complete(self, key: tuple[int, int, int], now: float) -> None:
        link = self.links[key]
        link.advance(now)
        tag, _, message = heapq.heappop(link.flows)
        link.virtual = max(link.virtual, tag)  # no rounding left over
        done = [message]
        while link.flows and link.flows[0][0] - link.virtual <= 1e-9 * max(1.0, tag):
            done.append(heapq.heappop(link.flows)[2])
        self._reschedule(key, link, now)
        for message in done:
            self._arrive(message, now)

    def _arrive(self, message: tuple, now: float) -> None:
        """The message's bytes are through: it arrives after the latency of its ranks' level."""
        self._link(message[0], message[1])
        latency = self.latency[(message[0], message[1])]
        if latency > 0:
            self._push(now + latency, DELIVER, message)
        else:
            self._deliver(message, now)

    def _deliver(self, message: tuple, now: float) -> None:
        waiter = self.waiting.pop(message, None)
        if waiter is None:
            self.arrived[message] = now
            return
        rank, since = waiter
        a = self.actions[rank][self.position[rank]]
        self._record(rank, a, since, now + self.recv_s)
        self._push(now + self.recv_s, RESUME, rank)

    # -- collectives, versions, memory ------------------------------------------------------

    def _gather(self, rank: int, a: Action, now: float) -> bool:
        """Arrive at a collective; when the group is complete, every member leaves at its end.
        Returns whether this rank goes on (it waits otherwise)."""
        arrivals = self.gathering.setdefault(a.collective, [])
        arrivals.append((rank, now))
        if len(arrivals) < len(a.group):
            self.clock[rank] = now
            return False
        del self.gathering[a.collective]
        seconds = 0.0
        if a.kind == "allreduce":
            seconds = self.ties[a.tie] if a.tie >= 0 else self.costs[a.stage].allreduce_s
        end = now + seconds
        for member, since in arrivals:
            self._record(member, self.actions[member][self.position[member]], since, end)
            self._push(end, RESUME, member)
        return True

    def _version(self, rank: int, a: Action, now: float) -> float:
        """What `push`, `pop` and `step` do to the rank's weights (`SimulatedWeights`): the
        seconds they take; the copies they keep or drop change its memory at once."""
        weights = self.weights[rank]
        before = weights.copies
        seconds = getattr(weights, a.kind)(*(() if a.kind == "step" else (a.microbatch,)))
        self._use(rank, now, weights.copies - before)
        return seconds

    def _use(self, rank: int, time: float, change: int) -> None:
        if change:
            self.used[rank] += change
            self.memory[rank].append((time, self.used[rank]))

    # -- results ----------------------------------------------------------------------------

    def result(self, start: dict[int, float], end: dict[int, float]) -> Simulation:
        """The simulation: the time per step is the longest call [start, end] of a rank (the
        ranks' calls overlap), and each rank's bubble the share of that time its own call
        spends outside compute."""
        span = max(end[r] - start[r] for r in self.actions)
        busy = dict.fromkeys(self.actions, 0.0)
        for e in self.events:
            if e.kind in COMPUTE and e.start >= start[e.rank]:
                busy[e.rank] += e.end - e.start
        count = max(self.actions) + 1
        bubble = [1.0 - busy[r] / span if span > 0 and r in busy else 0.0 for r in range(count)]
        memory = [self.memory.get(r, [(0.0, 0)]) for r in range(count)]
        return Simulation(
            plan=self.plan, schedule=self.schedule, timeline=self.events, time_per_step=span,
            bubble_fraction=bubble, peak_memory=[max(b for _, b in m) for m in memory],
            memory=memory,
        )  # fmt: skip
