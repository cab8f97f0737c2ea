"""Build every rank's actions for a plan under `1f1b`, `gpipe`, `pipedream`, `2bw`.

Pure and torch-free. Inputs: the ranks of each stage (a stage's replicas, in order), the stage
pairs that exchange tensors (`edges[(src, dst)]` is True when gradients flow back along it) and
the number of microbatches. Microbatch k runs on replica k mod r_s of stage s. Each replica runs
its microbatches in order: `gpipe` all forwards then all backwards; the others w_s warm-up
forwards (`versions.warmup`; `versions.two_bw_warmup` for `2bw`), then one forward and one
backward alternately, then the remaining backwards. Receives come right before the compute that
needs them, sends right after the compute that produced them (the executor posts receives early
and never blocks a sender). The streaming schedules (`pipedream`, `2bw`) stash a weight version
per microbatch (`push`/`pop`) and update after each round, in a stream of steps that never
drains between them; the synchronous ones update once at the end of their one step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from pdcompile.errors import ScheduleError
from pdcompile.plans import SCHEDULES
from pdcompile.runtime.actions import Action, Schedule
from pdcompile.runtime.versions import two_bw_warmup, warmup

Edges = Mapping[tuple[int, int], bool]
NONFINITE = ("raise", "skip")  # what a step with a NaN or infinite loss does
SKIPPABLE = ("1f1b", "gpipe")  # schedules whose steps can be skipped on every rank together
STREAMING = ("pipedream", "2bw")  # minibatches stay in flight across train_step calls


def check_nonfinite(kind: str, nonfinite: str) -> None:
    """Raise `ScheduleError` unless `nonfinite` is known and `kind` can honour it."""
    if nonfinite not in NONFINITE:
        raise ScheduleError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    if nonfinite == "skip" and kind not in SKIPPABLE:
        raise ScheduleError(
            f"nonfinite='skip' needs a synchronous schedule ({', '.join(SKIPPABLE)}): under {kind} "
            "updates of different minibatches overlap, so one step cannot be skipped on every "
            "stage; use nonfinite='raise' or schedule='1f1b'"
        )


def compute_item(kind: str, warmup_forwards: int, mine: Sequence[int], t: int) -> tuple[str, int]:
    """Item t (of 2 * len(mine)) of one replica's forwards and backwards for its microbatches
    `mine`: `gpipe` all forwards, then all backwards; the others w warm-up forwards, then a
    forward and a backward alternately, then the remaining backwards. Computed, not listed:
    `mine` may be a range of endless length (a stream)."""
    n = len(mine)
    if kind == "gpipe":
        return ("F", mine[t]) if t < n else ("B", mine[t - n])
    w = min(warmup_forwards, n)
    if t < w:
        return "F", mine[t]
    t -= w
    pairs = n - w  # backwards with a forward before them
    if t < 2 * pairs:
        return ("F", mine[t // 2 + w]) if t % 2 == 0 else ("B", mine[t // 2])
    return "B", mine[pairs + t - 2 * pairs]


def compute_order(kind: str, warmup_forwards: int, mine: Sequence[int]) -> list[tuple[str, int]]:
    """One replica's forwards and backwards, in order, for its microbatches `mine`."""
    return [compute_item(kind, warmup_forwards, mine, t) for t in range(2 * len(mine))]


def build_schedule(
    kind: str,
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
        kind: "1f1b", "gpipe", "pipedream" or "2bw".
        ranks: per stage, the ranks of its replicas.
        edges: (source stage, destination stage) -> whether gradients flow back.
        num_microbatches: microbatches per step (PipeDream minibatches under `pipedream`).
        ties: per tie group, the stages using the tensor: before each update their ranks sum
            its gradients.
        clip: clip the gradients' norm before each update: over all ranks together (`1f1b`,
            `gpipe`, `2bw`), per stage for `pipedream`, where stages linked by tie groups clip
            together (one norm over their gradients, so tied copies stay equal).
        skip_nonfinite: before the update every rank learns whether a loss of the step was NaN
            or infinite (a `check` all-reduce over all ranks) and, if so, skips it (`1f1b`,
            `gpipe` only).
        num_steps: the streaming schedules (`pipedream`, `2bw`) run this many steps as one
            stream, microbatch k of it in step k // M, without draining between steps: each
            replica updates after its last backward of a round (`pipedream`: r_s minibatches;
            `2bw`: one step). The synchronous schedules run exactly one step.

    Raises:
        ScheduleError: unknown kind, bad stage pairs, too few microbatches for `2bw`,
            `skip_nonfinite` with an asynchronous schedule, several steps of a synchronous one.
    """
    if num_steps < 1 or (num_steps > 1 and kind not in STREAMING):
        raise ScheduleError(
            f"{kind} cannot build {num_steps} steps as one schedule: only the streaming "
            f"schedules ({', '.join(STREAMING)}) run several steps without draining; build one"
        )
    orders = rank_orders(kind, ranks, edges, num_microbatches, ties, clip, skip_nonfinite)
    total = num_microbatches * num_steps
    first = next(iter(orders.values())).schedule
    actions = {rank: order.actions(total) for rank, order in orders.items()}
    return Schedule(kind, total, first.replicas, first.ranks, actions)


def rank_orders(
    kind: str,
    ranks: Sequence[Sequence[int]],
    edges: Edges,
    num_microbatches: int,
    ties: Sequence[Sequence[int]] = (),
    clip: bool = False,
    skip_nonfinite: bool = False,
) -> dict[int, RankOrder]:
    """Per rank, how its actions unfold for any number of microbatches (`build_schedule`'s
    arguments; the streams of `runtime/stream.py` unfold them without end)."""
    if kind not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    check_nonfinite(kind, "skip" if skip_nonfinite else "raise")
    ranks = tuple(tuple(r) for r in ranks)
    replicas = tuple(len(r) for r in ranks)
    stages = len(ranks)
    if num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if kind == "2bw" and num_microbatches < stages:
        raise ScheduleError(
            f"2bw needs at least as many microbatches as stages ({stages}), got "
            f"{num_microbatches}; raise num_microbatches"
        )
    if kind == "pipedream" and any(num_microbatches % r for r in replicas):
        raise ScheduleError(
            f"pipedream updates a stage once per round of its replicas ({list(replicas)}); give "
            f"a number of minibatches that every replica count divides, got {num_microbatches}"
        )
    if kind == "2bw" and any(num_microbatches % r for r in replicas):
        raise ScheduleError(
            f"2bw streams steps, so every replica of a stage must hold as many microbatches of "
            f"each step (replicas {list(replicas)}); give a number of microbatches that every "
            f"replica count divides, got {num_microbatches}"
        )
    for src, dst in edges:
        if not 0 <= src < dst < stages:
            raise ScheduleError(
                f"channel from stage {src} to stage {dst}: tensors must flow to a later stage of "
                f"the {stages}"
            )
    ties = [tuple(sorted(set(t))) for t in ties]
    if kind == "pipedream" and any(replicas[s] > 1 for t in ties for s in t):
        raise ScheduleError(
            "pipedream with a tied tensor on a replicated stage is not supported: its copies "
            "would update once per round of different replica counts; tie stages must have one "
            "replica each"
        )
    schedule = Schedule(kind, num_microbatches, replicas, ranks)
    world = tuple(sorted(r for rs in ranks for r in rs))
    linked = tie_components(stages, ties)
    orders = {}
    for s, stage_ranks in enumerate(ranks):
        if kind == "2bw":
            w, round_size = two_bw_warmup(replicas, s, num_microbatches), num_microbatches
        else:
            w, round_size = warmup(replicas, s), replicas[s]  # pipedream: a round of replicas
        my_ties = [
            (i, tuple(sorted(r for t in tie for r in ranks[t])))
            for i, tie in enumerate(ties)
            if s in tie
        ]
        clip_group = world if clip else None
        if clip and kind == "pipedream":  # per stage (an empty group), or with its tied stages
            tied = linked[s] if len(linked[s]) > 1 else ()
            clip_group = tuple(sorted(r for t in tied for r in ranks[t]))
        update = _update(s, ranks[s], my_ties, clip_group, world if skip_nonfinite else None)
        peers = Peers(
            into=tuple(sorted(src for src, dst in edges if dst == s)),
            out=tuple(sorted(dst for src, dst in edges if src == s)),
            grads_from=tuple(sorted(d for (a, d), grads in edges.items() if a == s and grads)),
            grads_to=tuple(sorted(a for (a, d), grads in edges.items() if d == s and grads)),
        )
        for i, rank in enumerate(stage_ranks):
            orders[rank] = RankOrder(schedule, peers, s, i, w, update, round_size)
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
    """One replica's actions, unfolded item by item: an item is one forward or backward with
    its communication, stashing and, after a round's last backward, the update (a streaming
    replica makes update u right after its last backward of round u: microbatches
    u * round_size to (u + 1) * round_size - 1 of its stage; it holds some of every round).
    A synchronous replica updates once, after its last item."""

    schedule: Schedule  # kind, ranks and replicas (its actions unused)
    peers: Peers
    stage: int
    replica: int
    warmup: int
    update: Callable[[int], list[Action]]
    round_size: int

    def mine(self, total: int) -> range:
        """This replica's microbatches among `total` (round-robin)."""
        return range(self.replica, total, self.schedule.replicas[self.stage])

    def actions(self, total: int) -> tuple[Action, ...]:
        """Every action for `total` microbatches."""
        actions: list[Action] = []
        for _, group in self.items(total):
            actions += group
        return tuple(actions)

    def items(self, total: int, start: int = 0) -> Iterator[tuple[int, list[Action]]]:
        """(item index, its actions) from item `start` on, for `total` microbatches (endless
        when `total` is: items are computed one at a time)."""
        mine, kind, w = self.mine(total), self.schedule.kind, self.warmup
        forward, backward = self._forward, self._backward
        for t in range(start, 2 * len(mine)):
            phase, k = compute_item(kind, w, mine, t)
            yield t, forward(k) if phase == "F" else backward(k)
        if kind not in STREAMING and start <= 2 * len(mine):
            yield 2 * len(mine), self.update(-1)

    def _forward(self, k: int) -> list[Action]:
        stage, schedule = self.stage, self.schedule
        actions = [
            _comm("recv", stage, k, schedule.rank_of(src, k), src, "act") for src in self.peers.into
        ]
        if schedule.kind in STREAMING:
            actions.append(Action("push", stage, k))
        actions.append(Action("F", stage, k))
        actions += [
            _comm("send", stage, k, schedule.rank_of(dst, k), dst, "act") for dst in self.peers.out
        ]
        return actions

    def _backward(self, k: int) -> list[Action]:
        stage, schedule = self.stage, self.schedule
        actions = [
            _comm("recv", stage, k, schedule.rank_of(dst, k), dst, "grad")
            for dst in self.peers.grads_from
        ]
        actions.append(Action("B", stage, k))
        actions += [
            _comm("send", stage, k, schedule.rank_of(src, k), src, "grad")
            for src in self.peers.grads_to
        ]
        if schedule.kind in STREAMING:
            actions.append(Action("pop", stage, k))
            group = schedule.replicas[stage]
            if (k + group) // self.round_size > k // self.round_size:  # its last of the round
                actions += self.update(k // self.round_size)
        return actions


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
        out = [Action("allreduce", stage, round_, group=ranks, tie=i) for i, ranks in ties]
        if len(group) > 1:
            out.append(Action("allreduce", stage, round_, group=group))
        if check_group is not None:
            out.append(Action("check", stage, round_, group=check_group))
        if clip_group is not None:
            out.append(Action("clip", stage, round_, group=clip_group))
        return [*out, Action("step", stage, round_)]

    return actions


def _comm(kind: str, stage: int, k: int, peer: int, peer_stage: int, stream: str) -> Action:
    return Action(kind, stage, k, peer, peer_stage, stream)  # positional: the fastest


def forward_schedule(
    ranks: Sequence[Sequence[int]], edges: Edges, num_microbatches: int
) -> Schedule:
    """Forwards only (evaluation): every microbatch on the first replica of each stage, so the
    last stage's first replica holds every output; no backwards, no updates."""
    firsts = tuple((tuple(r)[0],) for r in ranks)
    actions = {}
    for stage, (rank,) in enumerate(firsts):
        into = sorted(src for src, dst in edges if dst == stage)
        out = sorted(dst for src, dst in edges if src == stage)
        mine: list[Action] = []
        for k in range(num_microbatches):
            mine += [_comm("recv", stage, k, firsts[src][0], src, "act") for src in into]
            mine.append(Action("F", stage, k))
            mine += [_comm("send", stage, k, firsts[dst][0], dst, "act") for dst in out]
        actions[rank] = tuple(mine)
    return Schedule("forward", num_microbatches, (1,) * len(firsts), firsts, actions)
