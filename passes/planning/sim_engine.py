"""The simulator's engine: every rank's actions run on an event heap in modelled time.

Compute takes the plan's seconds (and the runtime's work on weight versions,
`passes/planning/simulated_weights.py`), a message travels from its `send` over the link it uses,
shared
fairly with the transfers on it at the same time, plus the level's latency; a `recv` waits for
its message and a collective for its whole group. An overlapped pair (`FB`, then a forward and a
backward part) runs its parts one after the other, the second shortened by the cluster's
`fb_overlap` share of the shorter part's seconds. `passes/planning/simulator.py` drives it call by
call.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from typing import Any

from pdcompile.core.errors import ScheduleError
from pdcompile.core.message_buffers import held_bytes
from pdcompile.passes.planning.action_costs import (
    LOSS_BYTES,
    scalar_allreduce_s,
    send_s,
    stage_costs,
    tie_costs,
)
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.simulated_weights import SimulatedWeights
from pdcompile.passes.planning.timeline import Event
from pdcompile.scheduling import Action, PipelineSchedule, Schedule
from pdcompile.scheduling.action_kinds import (
    ALLREDUCE,
    CLIP,
    KINDS,
    POP,
    PUSH,
    RECV,
    SEND,
    STEP,
    TABLE,
    ActionKind,
    needs_microbatch,
)
from pdcompile.scheduling.reduce_overlap import overlap_triggers


def message_buffers(plan: Plan, ranks: Iterable[int]) -> dict[int, int]:
    """Per rank, the bytes of message buffers the runtime keeps (`held_bytes`): `IN_USE` per size
    of the messages it sends or receives, to or from another rank (gradients travel back at
    their activations' size)."""
    sizes: dict[int, list[int]] = {r: [] for r in ranks}
    for stage in plan.stages:
        for src, size in stage.recv_bytes:
            senders = plan.stages[src].ranks
            for r in {*senders, *stage.ranks} - ({*senders} & {*stage.ranks}):
                sizes[r].append(size)
    return {r: held_bytes(s) for r, s in sizes.items()}


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


class Engine:
    """Runs every rank's actions (`schedule`, built from `rules`) on an event heap;
    `run_call(bound)` runs until every rank is done, blocked, or at its first action that needs
    a forward minibatch >= `bound`."""

    def __init__(self, plan: Plan, schedule: Schedule, rules: PipelineSchedule) -> None:
        self.plan, self.schedule = plan, schedule
        self.actions = schedule.actions
        self._prices(plan)
        self._state(rules)
        self._memory(plan, rules)

    def _prices(self, plan: Plan) -> None:
        """Seconds per action and message, and the cluster's links."""
        cluster = plan.cluster
        # a compute kind's seconds: the stage's fields the action table names, summed
        self.seconds = {(s.index, row.letter): sum(getattr(s, f) for f in row.seconds)
                        for s in plan.stages for row in TABLE if row.is_compute}  # fmt: skip
        self.bytes = {(src, s.index): size for s in plan.stages for src, size in s.recv_bytes}
        self.costs = stage_costs(plan, cluster)
        self.ties = tie_costs(plan, cluster)
        self.clip_s = dict.fromkeys(self.actions, 0.0)  # a rank's clip: all its stages' gradients
        for s in plan.stages:
            for r in s.ranks:
                self.clip_s[r] += self.costs[s.index].clip_s
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
        self.fb_overlap = cluster.runtime.fb_overlap

    def _state(self, rules: PipelineSchedule) -> None:
        """Where every rank is, the event heap, the messages and collectives under way."""
        self.hidden: dict[tuple[int, int], float] = {}  # (rank, action index) -> seconds saved
        self.position = dict.fromkeys(self.actions, 0)
        self.clock = dict.fromkeys(self.actions, 0.0)  # when each rank last stopped
        self.last_compute: dict[int, ActionKind] = {}  # what each rank computed last
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self.sequence = 0
        self.arrived: dict[tuple, float] = {}
        self.waiting: dict[tuple, tuple[int, float]] = {}  # message -> (rank, since)
        self.gathering: dict[tuple, list[tuple[int, float]]] = {}  # collective -> arrivals
        self.events: list[Event] = []
        self.release = dict.fromkeys(self.actions, 0.0)  # when each rank starts the next call
        self.bound = math.inf
        # replicas reducing from their last backward: when each is halfway through it
        self.triggers = {} if rules.streaming else overlap_triggers(self.actions)
        self.reduce_ready: dict[tuple[int, int], float] = {}

    def _memory(self, plan: Plan, rules: PipelineSchedule) -> None:
        """Memory per rank and per (rank, stage): weights, activations in flight, copies."""
        self.kept = {s.index: s.activation_bytes for s in plan.stages}
        # what a split backward's I leaves for its W (of the activations; recomputing, of
        # those I's forward made again) and what a recomputing backward holds while it runs
        self.kept_for_w = {
            s.index: s.weight_grad_activation_bytes if s.recompute
            else min(s.weight_grad_activation_bytes, s.activation_bytes)
            for s in plan.stages
        }  # fmt: skip
        self.recomputed = {s.index: s.recompute_bytes for s in plan.stages}
        self.weights = {
            (r, s.index): SimulatedWeights(rules, plan.num_microbatches, self.costs[s.index],
                                           s.param_bytes, s.grad_bytes)
            for s in plan.stages for r in s.ranks
        }  # fmt: skip
        # gradients are held from a stage's first backward (B or W) to its update
        self.stage_used = {
            (r, s.index): s.weight_bytes - s.grad_bytes for s in plan.stages for r in s.ranks
        }
        self.stage_peak = dict(self.stage_used)
        self.used = dict.fromkeys(self.actions, 0)
        for (r, _), used in self.stage_used.items():
            self.used[r] += used
        self.held_peak = dict(self.used)
        # of it, what the memory probe's parts do not see: the message buffers the runtime
        # keeps (reported apart), and what a recomputing B holds inside it only
        self.messages = message_buffers(plan, self.actions)
        self.transient = dict(self.messages)
        for r, held in self.messages.items():
            self.used[r] += held
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
        actions, position, bound = self.actions[rank], self.position, self.bound
        while position[rank] < len(actions):
            a = actions[position[rank]]
            letter, stage = a.kind, a.stage
            if a.microbatch >= bound and needs_microbatch(letter, a.stream):
                break  # the next call gives this minibatch
            row = KINDS[letter]
            if row.computes:
                self._compute(rank, a, row, now)
                return
            if letter == RECV:
                message = (a.peer, rank, *a.key)
                arrival = self.arrived.pop(message, None)
                if arrival is None:
                    self.waiting[message] = (rank, now)
                    break
                # a message sent in an earlier call may still travel at its end
                end = max(now, arrival) + (self.recv_s if a.peer != rank else 0.0)
            elif a.is_collective:
                if not self._gather(rank, a, now):
                    break
                return
            elif letter == SEND:
                end = now + (self.send_s[a.key[2:]] if a.peer != rank else 0.0)
                if end > now:  # packed and posted: the transfer starts after
                    self._push(end, TRANSFER, (rank, a))
                else:
                    self._transfer(rank, a, now)
            elif letter == CLIP:  # one stage's own norm (`pipedream`: clipped per stage)
                end = now + self.costs[stage].clip_s
            elif row.brackets:
                self._pair(rank, position[rank], row.brackets)
                end = now
            else:
                end = now + self._version(rank, a, now) if letter in (PUSH, POP, STEP) else now
            self._record(rank, a, now, end)
            if end > now:
                self._push(end, RESUME, rank)
                return
        self.clock[rank] = now

    def _compute(self, rank: int, a: Action, row: ActionKind, now: float) -> None:
        """Run a compute action (its seconds, and the runtime's work on the weights), and
        hold what the action table says it holds (an overlapped pair's last part shortened by
        what the pair hides: `_pair`): a forward's activations from its start; a
        backward part's changes at its end (the activations it frees, the weight gradient's
        part a split backward's I leaves, the gradients it adds), a recomputing one holding
        the forward's activations again while it runs."""
        stage = a.stage
        hidden = self.hidden.pop((rank, self.position[rank]), 0.0)  # the end of a pair
        end = now + self.seconds[(stage, a.kind)] - hidden
        weights = self.weights[(rank, stage)]
        grads = weights.grads
        if row.starts:
            end += weights.forward()
        elif row.accumulates:  # the weights' gradients accumulate (I leaves them to W)
            end += weights.backward(a.microbatch)
        last = self.last_compute.get(rank)
        if row.starts and last is not None and last.accumulates:
            end += self.costs[stage].reload_s  # the backward pushed the weights out
        self.last_compute[rank] = row
        if row.autograd_gradients and self.triggers.get((rank, stage)) == a.microbatch:
            self.reduce_ready[(rank, stage)] = (now + end) / 2
        self._record(rank, a, now, end)
        full, part = row.holds
        held = full * self.kept[stage] + part * self.kept_for_w[stage]
        if row.starts:
            self._use(rank, stage, now, held)
        else:
            again = self.recomputed[stage] if row.recomputes else 0
            inside = again if row.recompute_inside else 0
            self._use(rank, stage, now, again, transient=inside)
            self._use(rank, stage, end, weights.grads - grads + held - again, transient=-inside)
        self._push(end, RESUME, rank)

    def _pair(self, rank: int, bracket: int, parts: int) -> None:
        """An overlapped pair opens at action `bracket` of `rank`: its last part (the `parts`
        compute actions right after it) takes `fb_overlap` of the shorter part's seconds less,
        so the pair takes max(F, B) + (1 - fb_overlap) min(F, B)."""
        after = self.actions[rank][bracket + 1 : bracket + 1 + parts]
        shorter = min(self.seconds[(a.stage, a.kind)] for a in after)
        self.hidden[(rank, bracket + parts)] = self.fb_overlap * shorter

    def _record(self, rank: int, a: Action, start: float, end: float) -> None:
        self.events.append(Event(rank, a.kind, a.stage, a.microbatch, start, end, a.peer))
        self.position[rank] += 1

    # -- messages ---------------------------------------------------------------------------

    def _transfer(self, rank: int, a: Action, now: float) -> None:
        """A sent message enters its link (or, without bytes, only waits the latency)."""
        message = (rank, a.peer, *a.key)
        if a.peer == rank:  # between two stages of one rank: handed over
            self._deliver(message, now)
            return
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
        if a.kind == ALLREDUCE and a.tie < 0 and (a.group[0], a.stage) in self.triggers:
            # started from the replicas' last backwards (pdcompile/scheduling/reduce_overlap.py)
            start = max(self.reduce_ready.pop((m, a.stage), now) for m in a.group)
            end = max(now, start + self.costs[a.stage].allreduce_s)
        elif a.kind == ALLREDUCE:
            end = now + (self.ties[a.tie] if a.tie >= 0 else self.costs[a.stage].allreduce_s)
        else:  # a clip's norm or a check's flag: one number, after each member's own work
            own = self.clip_s if a.kind == CLIP else dict.fromkeys(self.clip_s, 0.0)
            start = max(since + own[member] for member, since in arrivals)
            end = start + scalar_allreduce_s(a.group, self.plan.cluster)
        for member, since in arrivals:
            self._record(member, self.actions[member][self.position[member]], since, end)
            self._push(end, RESUME, member)
        return True

    def _version(self, rank: int, a: Action, now: float) -> float:
        """What `push`, `pop` and `step` do to the rank's weights (`SimulatedWeights`): the
        seconds they take; the copies they keep or drop change its memory at once, then the
        gradients they free (a copy is made while the gradients are still held)."""
        weights = self.weights[(rank, a.stage)]
        copies, grads = weights.copies, weights.grads
        seconds = getattr(weights, a.kind)(*(() if a.kind == STEP else (a.microbatch,)))
        self._use(rank, a.stage, now, weights.copies - copies)
        self._use(rank, a.stage, now, weights.grads - grads)
        return seconds

    def _use(self, rank: int, stage: int, time: float, change: int, transient: int = 0) -> None:
        """`change` bytes in use on `rank` for `stage` from `time`, of them `transient` held
        inside a backward only."""
        self.transient[rank] += transient
        if change:
            self.used[rank] += change
            self.held_peak[rank] = max(self.held_peak[rank], self.used[rank] - self.transient[rank])
            self.memory[rank].append((time, self.used[rank]))
            key = (rank, stage)
            self.stage_used[key] += change
            self.stage_peak[key] = max(self.stage_peak[key], self.stage_used[key])
