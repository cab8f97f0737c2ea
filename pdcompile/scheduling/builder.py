"""Every rank's actions for a plan under a schedule: the one builder all schedules share.

Pure and torch-free. Inputs: the ranks of each stage (a stage's replicas, in order; a rank may
hold several stages), the stage pairs that exchange tensors (`edges[(src, dst)]` is True when
gradients flow back along it) and the number of microbatches. Microbatch k runs on replica
k mod r_s of stage s. Each rank's compute comes from its schedule (`rank_orders`: (kind, stage,
microbatch) items, fused "B" or split "I"/"W"); each item brings its messages as the action
table says (`action_kinds`): receives come right before the compute that needs them, sends
right after the compute that produced them (executors post receives early and never block a
sender); an overlapped pair (`FB` and its two parts) receives both parts' messages before it
and sends both after it. Streaming schedules stash a weight version per microbatch
(`push`/`pop`) and update after each round, in a stream of steps that never drains;
synchronous ones update once at the end of their one step: every stage's all-reduces, one
check and one clip for the rank, then every stage's optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import networkx as nx

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.action_kinds import (
    ACT,
    ALLREDUCE,
    CHECK,
    CLIP,
    GRAD,
    POP,
    PUSH,
    RECV,
    SEND,
    STEP,
    F,
    is_compute,
    kind,
    overlappable,
    ways,
)
from pdcompile.scheduling.actions import Action, Schedule
from pdcompile.scheduling.base import PipelineSchedule
from pdcompile.scheduling.placement import Item, Placement
from pdcompile.scheduling.registry import get_schedule

Edges = Mapping[tuple[int, int], bool]
NONFINITE = ("raise", "skip")  # what a step with a NaN or infinite loss does


def check_nonfinite(schedule: str | PipelineSchedule, nonfinite: str) -> None:
    """Raise `ScheduleError` unless `nonfinite` is known and `schedule` can honour it."""
    _check_nonfinite(get_schedule(schedule), nonfinite)


def _check_nonfinite(rules: PipelineSchedule, nonfinite: str) -> None:
    if nonfinite not in NONFINITE:
        raise ScheduleError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    if nonfinite == "skip" and not rules.synchronous:
        raise ScheduleError(
            f"nonfinite='skip' needs a synchronous schedule (one update per step): under "
            f"{rules.name} updates of different minibatches overlap, so one step cannot be "
            "skipped on every stage; use nonfinite='raise' or schedule='1f1b'"
        )


def compute_order(
    schedule: str | PipelineSchedule, warmup: int, mine: Sequence[int]
) -> list[tuple[str, int]]:
    """One replica's compute, in order, for its microbatches `mine` (a `WarmupSchedule`'s,
    with that warm-up)."""
    rules = get_schedule(schedule)
    count = rules.items_per_microbatch * len(mine)
    return [rules.compute_item(warmup, mine, t) for t in range(count)]


def build_schedule(
    schedule: str | PipelineSchedule,
    ranks: Sequence[Sequence[int]],
    edges: Edges,
    num_microbatches: int,
    ties: Sequence[Sequence[int]] = (),
    clip: bool = False,
    skip_nonfinite: bool = False,
    num_steps: int = 1,
) -> Schedule:
    """Every rank's actions for `num_steps` steps of `num_microbatches` microbatches.

    Args:
        schedule: a registered name (`pdcompile.schedules()`) or a `PipelineSchedule`.
        ranks: per stage, the ranks of its replicas.
        edges: (source stage, destination stage) -> whether gradients flow back.
        num_microbatches: microbatches per step (PipeDream minibatches under `pipedream`).
        ties: per tie group, the stages using the tensor: before each update their ranks sum
            its gradients.
        clip: clip the gradients' norm before each update, over the schedule's clip groups.
        skip_nonfinite: before the update every rank learns whether a loss of the step was NaN
            or infinite (a `check` all-reduce over all ranks) and, if so, skips it (synchronous
            schedules only).
        num_steps: streaming schedules run this many steps as one stream, microbatch k of it in
            step k // M, without draining between steps. Synchronous ones run exactly one.

    Raises:
        ScheduleError: unknown schedule, bad stage pairs, a microbatch count the schedule does
            not accept, `skip_nonfinite` with an asynchronous schedule, several steps of a
            synchronous one.
    """
    layout = Layout(ranks, edges, num_microbatches, ties, clip, skip_nonfinite)
    return build(get_schedule(schedule), layout, num_steps)


def build(rules: PipelineSchedule, layout: Layout, num_steps: int = 1) -> Schedule:
    """`build_schedule` under the schedule object `rules`, for `layout`: what the simulator and
    the executors call with the schedule they hold."""
    if num_steps < 1 or (num_steps > 1 and not rules.streaming):
        raise ScheduleError(
            f"{rules.name} cannot build {num_steps} steps as one schedule: only streaming "
            "schedules run several steps without draining; build one"
        )
    orders = replica_orders(rules, layout)
    total = layout.num_microbatches * num_steps
    first = next(iter(orders.values())).schedule
    if rules.streaming:  # one stage per rank, its rounds' updates inside its order
        actions = {rank: order.actions(total) for (rank, _), order in sorted(orders.items())}
    else:
        placement = Placement(first.ranks, dict(layout.edges), layout.num_microbatches, total)
        actions = _ranked(rules, orders, rules.rank_orders(placement), total)
    return Schedule(rules.name, total, first.replicas, first.ranks, actions)


class Layout(NamedTuple):
    """What a schedule is built for (`build_schedule`'s arguments but the steps)."""

    ranks: Sequence[Sequence[int]]
    edges: Edges
    num_microbatches: int
    ties: Sequence[Sequence[int]] = ()
    clip: bool = False
    skip_nonfinite: bool = False


def replica_orders(rules: PipelineSchedule, layout: Layout) -> dict[tuple[int, int], RankOrder]:
    """Per (rank, stage), how that replica's actions unfold for any number of microbatches (the
    streams of `runtime/stream.py` unfold them without end, one stage per rank) under the
    schedule `rules`."""
    ranks, edges, num_microbatches, ties, clip, skip_nonfinite = layout
    _check_nonfinite(rules, "skip" if skip_nonfinite else "raise")
    ranks = tuple(tuple(r) for r in ranks)
    replicas = tuple(len(r) for r in ranks)
    stages = len(ranks)
    ties = [tuple(sorted(set(t))) for t in ties]
    rules.check(replicas, num_microbatches, ties)
    rules.check_layout(ranks, num_microbatches)
    for src, dst in edges:
        if not 0 <= src < dst < stages:
            raise ScheduleError(
                f"channel from stage {src} to stage {dst}: tensors must flow to a later stage of "
                f"the {stages}"
            )
    for s, stage_ranks in enumerate(ranks):
        if len(set(stage_ranks)) < len(stage_ranks):
            raise ScheduleError(f"stage {s} has two replicas on one rank: {list(stage_ranks)}")
    shared = len({r for rs in ranks for r in rs}) < sum(replicas)
    if shared and rules.streaming:
        raise ScheduleError(
            f"{rules.name} streams steps without a flush, which pdcompile runs with one stage "
            "per rank; place each stage on ranks of its own, or use a synchronous schedule"
        )
    schedule_ = Schedule(rules.name, num_microbatches, replicas, ranks)
    world = tuple(sorted({r for rs in ranks for r in rs}))
    linked = tie_components(stages, ties)
    orders = {}
    placement = Placement(ranks, dict(edges), num_microbatches)
    for s, stage_ranks in enumerate(ranks):
        round_size = rules.weights.round_size(placement, s)
        my_ties = [  # stages of a tie on one rank: the rank sums their copies (RankWorkers)
            (i, tuple(sorted({r for t in tie for r in ranks[t]})))
            for i, tie in enumerate(ties)
            if s in tie
        ]
        clip_group = rules.weights.clip_group(placement, s, linked[s]) if clip else None
        update = _update(s, ranks[s], my_ties, clip_group, world if skip_nonfinite else None)
        peers = Peers(placement.into(s), placement.out(s), placement.grads_from(s),
                      placement.grads_to(s))  # fmt: skip
        for i, rank in enumerate(stage_ranks):
            orders[(rank, s)] = RankOrder(schedule_, rules, peers, s, i, update, round_size,
                                          dict(edges))  # fmt: skip
    return orders


def tie_components(stages: int, ties: Sequence[Sequence[int]]) -> list[frozenset[int]]:
    """Per stage, the stages linked to it through tie groups (itself alone when untied)."""
    graph = nx.Graph()
    graph.add_nodes_from(range(stages))
    for tie in ties:
        members = sorted(tie)
        graph.add_edges_from(zip(members, members[1:], strict=False))
    component = {s: frozenset(c) for c in nx.connected_components(graph) for s in c}
    return [component[s] for s in range(stages)]


@dataclass(frozen=True)
class Peers:
    """The stages one stage exchanges messages with: activations come from `into` and go to
    `out`; gradients come back from `grads_from` and go back to `grads_to`."""

    into: tuple[int, ...]
    out: tuple[int, ...]
    grads_from: tuple[int, ...]
    grads_to: tuple[int, ...]


@dataclass(frozen=True)
class RankOrder:
    """One replica's actions, unfolded item by item: an item is one compute action (a
    forward, a backward or a part of a split one) with its communication, stashing and, after
    a round's last backward, the update (a streaming replica makes update u right after its
    last backward of round u: microbatches u * round_size to (u + 1) * round_size - 1 of its
    stage). A synchronous replica updates once, after its last item."""

    schedule: Schedule  # kind, ranks and replicas (its actions unused)
    rules: PipelineSchedule
    peers: Peers
    stage: int
    replica: int
    update: Callable[[int], list[Action]]
    round_size: int
    edges: Mapping[tuple[int, int], bool]

    @property
    def rank(self) -> int:
        return self.schedule.ranks[self.stage][self.replica]

    def mine(self, total: int) -> range:
        """This replica's microbatches among `total` (round-robin)."""
        return range(self.replica, total, self.schedule.replicas[self.stage])

    def actions(self, total: int) -> tuple[Action, ...]:
        """Every action for `total` microbatches."""
        actions: list[Action] = []
        for _, group in self.items(total):
            actions += group
        return tuple(actions)

    def count(self, total: int) -> int:
        """Compute items for `total` microbatches."""
        return self.rules.items_per_microbatch * len(self.mine(total))

    def order(self, total: int) -> Sequence[Item]:
        """The schedule's order of this replica's rank for `total` microbatches (one stage per
        rank: this replica's own; a stream's computed item by item)."""
        schedule = self.schedule
        placement = Placement(schedule.ranks, self.edges, schedule.num_microbatches, total)
        return self.rules.rank_orders(placement)[self.rank]

    def items(self, total: int, start: int = 0) -> Iterator[tuple[int, list[Action]]]:
        """(item index, its actions) from item `start` on, for `total` microbatches (endless
        when `total` is: items are computed one at a time), this replica's stage's items of its
        rank's order. A synchronous replica's update is the item after its last compute."""
        count = self.count(total)
        order = self.order(total)
        if len(self.schedule.stages_of(self.rank)) > 1:
            order = [item for item in order if item[1] == self.stage]
        for t in range(start, count):
            letter, _, k = order[t]
            yield t, self.compute(letter, k)
        if not self.rules.streaming and start <= count:
            yield count, self.update(-1)

    def compute(self, letter: str, k: int) -> list[Action]:
        """The actions of one compute item, `letter` of microbatch `k`, with its messages as
        the action table says: what it receives before it, what it sends after it; a stream
        stashes the weight version before a forward and drops it (then updates, after a
        round's last microbatch) after the item that ends the microbatch."""
        row = kind(letter)
        if row.brackets:
            raise ScheduleError(
                f"{self.rules.name}: an overlapped pair ({letter!r}) runs in a synchronous "
                "schedule's rank orders only, not in a stream's"
            )
        if not row.is_compute:
            raise ScheduleError(f"{self.rules.name}: unknown compute kind {letter!r}")
        stage, schedule = self.stage, self.schedule
        actions = self.receives(letter, k)
        if self.rules.streaming and row.starts:
            actions.append(Action(PUSH, stage, k))
        actions.append(Action(letter, stage, k))
        actions += self.sends(letter, k)
        if self.rules.streaming and row.ends:
            actions.append(Action(POP, stage, k))
            group = schedule.replicas[stage]
            if (k + group) // self.round_size > k // self.round_size:  # its last of the round
                actions += self.update(k // self.round_size)
        return actions

    def receives(self, letter: str, k: int) -> list[Action]:
        """What compute item `letter` of microbatch `k` receives before it (the action table's
        `receives`): activations from the stages feeding this one, or gradients back."""
        stream, schedule, peers = kind(letter).receives, self.schedule, self.peers
        sources = {ACT: peers.into, GRAD: peers.grads_from}.get(stream, ())
        return [_comm(RECV, self.stage, k, schedule.rank_of(s, k), s, stream) for s in sources]

    def sends(self, letter: str, k: int) -> list[Action]:
        """What compute item `letter` of microbatch `k` sends after it (`sends`): activations
        to the stages it feeds, or gradients back to those feeding it."""
        stream, schedule, peers = kind(letter).sends, self.schedule, self.peers
        targets = {ACT: peers.out, GRAD: peers.grads_to}.get(stream, ())
        return [_comm(SEND, self.stage, k, schedule.rank_of(s, k), s, stream) for s in targets]


def _updates(finals: Mapping[int, list[Action]]) -> list[Action]:
    """A rank's updates, after all its compute: every stage's all-reduces, one check and one
    clip for the rank (its first stage names them), then every stage's optimizer step
    (`finals[stage]`: that stage's update actions)."""
    updates = [finals[stage] for stage in sorted(finals)]
    # one all-reduce per tied tensor (on several of the rank's stages, its first names it),
    # in an order every rank agrees on: the ties by index, then the replicas by stage
    reduces = {}
    for a in (a for u in updates for a in u if a.kind == ALLREDUCE):
        reduces.setdefault(a.collective, a)
    reduces = sorted(reduces.values(), key=lambda a: (a.tie < 0, a.tie, a.stage))
    once = [a for a in updates[0] if a.kind in (CHECK, CLIP)]
    steps = [a for u in updates for a in u if a.kind == STEP]
    return reduces + once + steps


def _ranked(
    rules: PipelineSchedule,
    orders: Mapping[tuple[int, int], RankOrder],
    ranked: Mapping[int, Sequence[Item]],
    total: int,
) -> dict[int, tuple[Action, ...]]:
    """Every rank's actions from the order the schedule gives each rank ((kind, stage,
    microbatch) items), checked against its stages' work: each microbatch of each of the
    rank's stages once per compute kind of one of its `ways` (F and B, or F, I and W), then the
    rank's updates."""
    actions = {}
    for rank in sorted({rank for rank, _ in orders}):
        items = list(ranked.get(rank, ()))
        stages = sorted(s for r, s in orders if r == rank)
        _check_work(rules, rank, stages, [i for i in items if is_compute(i[0])],
                    {s: orders[(rank, s)].mine(total) for s in stages})  # fmt: skip
        out: list[Action] = []
        t = 0
        while t < len(items):
            letter, s, k = items[t]
            span = kind(letter).brackets
            if span:
                out += _overlap(rules, rank, orders, items[t], items[t + 1 : t + 1 + span])
            else:
                out += orders[(rank, s)].compute(letter, k)
            t += 1 + span
        finals = {s: orders[(rank, s)].update(-1) for s in stages}
        actions[rank] = tuple(out + _updates(finals))
    return actions


def _check_work(
    rules: PipelineSchedule,
    rank: int,
    stages: list[int],
    items: list[Item],
    mine: Mapping[int, range],
) -> None:
    """`ScheduleError` unless the compute `items` of `rank`'s order run each microbatch of its
    `stages` (`mine[stage]`) once per compute kind of one of the schedule's `ways`."""
    work: dict[tuple[int, int], list[str]] = {}
    for letter, s, k in items:
        work.setdefault((s, k), []).append(letter)
    want = {(s, k) for s in stages for k in mine[s]}
    allowed = ways(rules.compute_kinds)
    wrong = sorted(set(work) ^ want) + sorted(
        (s, k, *w) for (s, k), w in work.items() if sorted(w) not in map(sorted, allowed)
    )
    if wrong:
        raise ScheduleError(
            f"{rules.name}'s order for rank {rank} does not run each microbatch of its stages "
            f"{stages} once per {' or '.join('/'.join(w) for w in allowed)} (e.g. {wrong[:4]}): "
            "a bug in the schedule's rank_orders"
        )


def _overlap(
    rules: PipelineSchedule,
    rank: int,
    orders: Mapping[tuple[int, int], RankOrder],
    bracket: Item,
    parts: Sequence[Item],
) -> list[Action]:
    """An overlapped pair's actions: both parts' receives, the bracket, the two parts, both
    parts' sends (the pair ends together)."""
    letter, s, k = bracket
    if not overlappable([p[0] for p in parts]) or parts[0][1:] != (s, k):
        raise ScheduleError(
            f"{rules.name}'s order for rank {rank}: {bracket} must be followed by its forward "
            f"(F, {s}, {k}) and a backward part, got {list(parts)}: write pairs with "
            "action_kinds.overlapped"
        )
    mine = [(orders[(rank, ps)], part, pk) for part, ps, pk in parts]
    before = [a for order, part, pk in mine for a in order.receives(part, pk)]
    after = [a for order, part, pk in mine for a in order.sends(part, pk)]
    return [*before, Action(letter, s, k), *(Action(*p) for p in parts), *after]


def _update(
    stage: int,
    group: tuple[int, ...],
    ties: list[tuple[int, tuple[int, ...]]],
    clip_group: tuple[int, ...] | None,
    check_group: tuple[int, ...] | None = None,
) -> Callable[[int], list[Action]]:
    """The actions of one update: sum tied gradients, average the rest among the replicas,
    agree over `check_group` whether to skip the step (a non-finite loss), clip (over
    `clip_group`, or per stage when it is empty), step the optimizer."""

    def actions(round_: int) -> list[Action]:
        out = [Action(ALLREDUCE, stage, round_, group=ranks, tie=i) for i, ranks in ties]
        if len(group) > 1:
            out.append(Action(ALLREDUCE, stage, round_, group=group))
        if check_group is not None:
            out.append(Action(CHECK, stage, round_, group=check_group))
        if clip_group is not None:
            out.append(Action(CLIP, stage, round_, group=clip_group))
        return [*out, Action(STEP, stage, round_)]

    return actions


def _comm(kind: str, stage: int, k: int, peer: int, peer_stage: int, stream: str) -> Action:
    return Action(kind, stage, k, peer, peer_stage, stream)  # positional: the fastest


def forward_schedule(
    ranks: Sequence[Sequence[int]], edges: Edges, num_microbatches: int
) -> Schedule:
    """Forwards only (evaluation): every microbatch on the first replica of each stage, so the
    last stage's first replica holds every output; no backwards, no updates. A rank holding
    several stages runs them in stage order per microbatch."""
    firsts = tuple((tuple(r)[0],) for r in ranks)
    actions: dict[int, list[Action]] = {}
    for k in range(num_microbatches):
        for stage, (rank,) in enumerate(firsts):
            into = sorted(src for src, dst in edges if dst == stage)
            out = sorted(dst for src, dst in edges if src == stage)
            mine = actions.setdefault(rank, [])
            mine += [_comm(RECV, stage, k, firsts[src][0], src, ACT) for src in into]
            mine.append(Action(F, stage, k))
            mine += [_comm(SEND, stage, k, firsts[dst][0], dst, ACT) for dst in out]
    frozen = {rank: tuple(a) for rank, a in sorted(actions.items())}
    return Schedule("forward", num_microbatches, (1,) * len(firsts), firsts, frozen, training=False)
