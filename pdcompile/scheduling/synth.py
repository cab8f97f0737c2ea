"""`synth`: an order synthesised for the stage times and memory at hand. Torch-free.

A greedy list scheduler builds every rank's order by running the step on modelled time: the
rank that can start something earliest starts it. Each stage's backward is split into I (input
gradients, sent back at once) and W (weight gradients), as in the zero-bubble schedules. A rank
starts, among what it holds ready (its inputs or gradients arrived):

- an I (or, with `Knobs.forward_first`, a forward first): gradients keep the ranks before it
  busy and free activations;
- a forward, if the activations it keeps fit the rank's budget (`Fitting.budget`, bytes of
  activations held: a microbatch between its F and I holds `held[s][0]`, between I and W
  `held[s][1]`) and the stage holds fewer than `Knobs.cap` microbatches (its W pending
  counted) beyond 1F1B's count (PipeDream's warm-up, plus one);
- a W, when nothing else is ready and the next arrival is at least `Knobs.fill` W's away (W's
  fill the bubbles), or when the budget blocks every forward.

With no fitting (`Fitting()`: equal times, no message time, each stage's budget 1F1B's count of
microbatches in flight) it is an order of the ZB-H1 family, which the solvers' memory counts
are walked off. `plan(..., schedule="synth")` fits it to the plan
(`passes/planning/order_search.py`): the stage times and message times of the plan, each
rank's memory limit (or 1F1B's activations on it without one), and the knobs whose simulated
step is shortest; the fitting travels in the plan (`options["synth"]`), so every rank and every
saved plan rebuilds the same orders (`for_plan`).

A greedy list scheduler rather than a CP-SAT model over the actions: it scales to thousands of
actions per rank in milliseconds, every order it builds runs (it is a simulated run), and the
search around it prices each candidate with the simulator itself; a time-boxed CP-SAT model
is exact only on its own time model and stops without a solution on large pipelines.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.action_kinds import F, I, W
from pdcompile.scheduling.base import PipelineSchedule
from pdcompile.scheduling.chunks import split_order
from pdcompile.scheduling.placement import Item, Placement
from pdcompile.scheduling.registry import register_schedule

OPTION = "synth"  # the plan's option holding the fitting and knobs (`for_plan`)


@dataclass(frozen=True)
class Fitting:
    """What the orders are fitted to (per stage unless said): `times` (F, I, W) seconds per
    microbatch, `message_s` seconds a message into the stage (or its gradient back) takes,
    `held` (bytes between F and I, between I and W) per microbatch, `budget` per rank, bytes
    of activations it may hold. Empty: equal times, free messages, one unit held, 1F1B's count
    of microbatches in flight per stage."""

    times: tuple[tuple[float, float, float], ...] = ()
    message_s: tuple[float, ...] = ()
    held: tuple[tuple[float, float], ...] = ()
    budget: Mapping[int, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"times": [list(t) for t in self.times], "message_s": list(self.message_s),
                "held": [list(h) for h in self.held],
                "budget": [[r, b] for r, b in sorted(self.budget.items())]}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fitting:
        return cls(
            tuple(tuple(map(float, t)) for t in data["times"]),
            tuple(map(float, data["message_s"])),
            tuple(tuple(map(float, h)) for h in data["held"]),
            {int(r): float(b) for r, b in data["budget"]},
        )


@dataclass(frozen=True)
class Knobs:
    """The greedy's choices: `forward_first` (a ready forward before a ready I), `fill` (a W
    runs while waiting when the next arrival is at least `fill` W's away), `cap` (forwards a
    stage holds beyond 1F1B's count; None: the budget alone limits them), `scale` (of the
    budgets: the simulator, not the greedy, says what a rank's peak is)."""

    forward_first: bool = False
    fill: float = 0.0
    cap: int | None = 0
    scale: float = 1.0

    def to_json(self) -> dict[str, Any]:
        return {"forward_first": self.forward_first, "fill": self.fill, "cap": self.cap,
                "scale": self.scale}  # fmt: skip


@dataclass(frozen=True)
class Split:
    """A zero-bubble order per stage (`chunks.split_order`, one stage per rank): `warmups[s]`
    forwards before the first I, `defers[s]` W's left waiting (ZB-H1: PipeDream's warm-ups,
    and the deepest less each)."""

    warmups: tuple[int, ...]
    defers: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"warmups": list(self.warmups), "defers": list(self.defers)}


Recipe = Knobs | Split


def recipe_from_json(data: Mapping[str, Any]) -> Recipe:
    """The recipe `to_json` wrote."""
    if "warmups" in data:
        return Split(tuple(map(int, data["warmups"])), tuple(map(int, data["defers"])))
    return Knobs(**data)


@register_schedule("synth")
class Synthesised(PipelineSchedule):
    """Synthesised: a greedy list scheduler's order for the plan's stage times and memory."""

    meaning = (
        "synchronous (synthesised): every rank's order of forwards, input-gradient and "
        "weight-gradient parts built for this plan's stage times, message times and memory "
        "by a greedy list scheduler; every stage updates once per step from all "
        "microbatches: exactly single-process gradient accumulation."
    )
    items_per_microbatch = 3

    def __init__(self, fitting: Fitting | None = None, recipe: Recipe | None = None) -> None:
        self.fitting, self.recipe = fitting or Fitting(), recipe or Knobs()

    def fitted(self, fitting: Fitting, recipe: Recipe) -> Synthesised:
        """This kind with its orders built for `fitting` by `recipe`."""
        fitted = type(self)(fitting, recipe)
        fitted.name = self.name
        return fitted

    def for_plan(self, options: Mapping[str, Any]) -> Synthesised:
        """The orders of a plan whose options hold its fitting (`OPTION`), else these."""
        saved = options.get(OPTION)
        if not saved:
            return self
        return self.fitted(Fitting.from_json(saved["fitting"]), recipe_from_json(saved["recipe"]))

    def chunk_rank(self, stage: int, num_ranks: int, chunks: int) -> int:
        """Two stages per rank sit in a V (the loss where the input is read); any other count
        round-robin."""
        if chunks == 2:
            return stage if stage < num_ranks else 2 * num_ranks - 1 - stage
        return stage % num_ranks

    def rank_orders(self, placement: Placement) -> Mapping[int, Sequence[Item]]:
        if isinstance(self.recipe, Knobs):
            return _Greedy(placement, self.fitting, self.recipe).orders()
        if not placement.one_stage_per_rank or len(self.recipe.warmups) != placement.num_stages:
            raise ScheduleError(
                f"synth: a per-stage split order of {len(self.recipe.warmups)} stages, one per "
                f"rank, cannot run stages on ranks {[list(r) for r in placement.ranks]}; plan "
                "again with schedule='synth'"
            )
        w, d = self.recipe.warmups, self.recipe.defers
        return {
            r: [(kind, s, k) for s in placement.stages_of(r)
                for kind, k in split_order(placement.mine(r, s), w[s], d[s])]
            for r in placement.world
        }  # fmt: skip


class _Greedy:
    """One run of the list scheduler on `placement` (docs in the module)."""

    def __init__(self, placement: Placement, fitting: Fitting, knobs: Knobs) -> None:
        self.p, self.knobs = placement, knobs
        stages = placement.num_stages
        self.times = fitting.times or ((1.0, 1.0, 1.0),) * stages
        self.message = fitting.message_s or (0.0,) * stages
        self.held = fitting.held or ((1.0, 1.0),) * stages
        if not len(self.times) == len(self.message) == len(self.held) == stages:
            raise ScheduleError(
                f"synth: the fitting gives {len(self.times)} stages' times, the placement has "
                f"{stages} stages; plan again with schedule='synth'"
            )
        # 1F1B's microbatches in flight at a replica of stage s: PipeDream's warm-up, plus one
        replicas = placement.replicas
        self.depth = [(sum(replicas[s:]) - 1) // replicas[s] + 1 for s in range(stages)]
        self.done: dict[Item, float] = {}
        self.clock = dict.fromkeys(placement.world, 0.0)
        self.order: dict[int, list[Item]] = {r: [] for r in placement.world}
        self.forwards = {(r, s): deque(placement.mine(r, s))
                         for r in placement.world for s in placement.stages_of(r)}  # fmt: skip
        self.inputs: dict[int, deque[tuple[int, int]]] = {r: deque() for r in placement.world}
        self.weights: dict[int, deque[tuple[int, int]]] = {r: deque() for r in placement.world}
        self.in_flight = dict.fromkeys(self.forwards, 0)
        self.bytes = dict.fromkeys(placement.world, 0.0)
        default = max(self._one_f_one_b(r) for r in placement.world)
        self.budget = {r: knobs.scale * fitting.budget.get(r, default) for r in placement.world}

    def _one_f_one_b(self, rank: int) -> float:
        """1F1B's activations on `rank`: each of its stages' count of microbatches in flight
        (the budget of every rank without a fitting is the largest: ZB-H1's)."""
        return sum(
            min(self.depth[s], len(self.p.mine(rank, s))) * self.held[s][0]
            for s in self.p.stages_of(rank)
        )

    def orders(self) -> dict[int, list[Item]]:
        left = sum(3 * len(q) for q in self.forwards.values())
        ranks = list(self.p.world)
        while left:
            choices = [(t, r, item) for r in ranks for t, item in [self._next(r)] if item]
            if not choices:
                raise ScheduleError(
                    "synth: no rank can start anything: the memory budget holds no forward "
                    f"(budgets {self.budget}); give more memory or another schedule"
                )
            start, rank, item = min(choices, key=lambda c: (c[0], c[1]))
            self._run(rank, item, start)
            left -= 1
        return self.order

    # -- what a rank can start, and when ------------------------------------------------------

    def _next(self, rank: int) -> tuple[float, Item | None]:
        """When `rank` starts its next item and which (None: it waits for another rank)."""
        now = self.clock[rank]
        backward = self._ready_input(rank)
        forward = self._ready_forward(rank)
        arrivals = [c for c in (backward, forward) if c is not None]
        ready = [c for c in arrivals if c[0] <= now]
        if ready:
            first = F if self.knobs.forward_first else I
            ready.sort(key=lambda c: (c[1][0] != first, c[0]))
            return now, ready[0][1]
        pending = self.weights[rank][0] if self.weights[rank] else None
        if pending is not None:
            soonest = min((c[0] for c in arrivals), default=self._earliest_unknown(rank))
            if soonest - now >= self.knobs.fill * self.times[pending[0]][2] or self._blocked(rank):
                return now, (W, *pending)
        if arrivals:
            start, item = min(arrivals, key=lambda c: (c[0], c[1][0] != I))
            return start, item
        return math.inf, None

    def _ready_input(self, rank: int) -> tuple[float, Item] | None:
        """The I of `rank` whose gradients are known and arrive first, and when."""
        best = None
        for s, k in self.inputs[rank]:
            arrives = self._arrival(s, k, backward=True)
            if arrives is None:
                continue
            ready = max(arrives, self.done[(F, s, k)])
            if best is None or ready < best[0]:
                best = (ready, (I, s, k))
        return best

    def _ready_forward(self, rank: int) -> tuple[float, Item] | None:
        """The next forward of `rank`'s stages whose inputs are known and that fits, the
        deepest stage first among those arriving together."""
        best = None
        for (r, s), queue in self.forwards.items():
            if r != rank or not queue or not self._admits(rank, s):
                continue
            arrives = self._arrival(s, queue[0], backward=False)
            if arrives is not None and (best is None or (arrives, -s) < (best[0], -best[1][1])):
                best = (arrives, (F, s, queue[0]))
        return best

    def _arrival(self, stage: int, k: int, backward: bool) -> float | None:
        """When microbatch `k`'s inputs (its gradients: `backward`) reach `stage`; None while
        one is not yet computed."""
        sources = self.p.grads_from(stage) if backward else self.p.into(stage)
        kind = I if backward else F
        times = []
        for other in sources:
            finished = self.done.get((kind, other, k))
            if finished is None:
                return None
            hop = self.p.rank_of(other, k) != self.p.rank_of(stage, k)
            times.append(finished + hop * self.message[max(other, stage)])
        return max(times, default=0.0)

    def _earliest_unknown(self, rank: int) -> float:
        """A lower bound of when the first gradients `rank` waits for, not yet computed, can
        arrive: their senders' clocks, an I and a message later."""
        bounds = [
            self.clock[self.p.rank_of(other, k)] + self.times[other][1] + self.message[other]
            for s, k in self.inputs[rank]
            for other in self.p.grads_from(s)
            if (I, other, k) not in self.done
        ]
        return min(bounds, default=math.inf)

    def _admits(self, rank: int, stage: int) -> bool:
        cap = self.knobs.cap
        if cap is not None and self.in_flight[(rank, stage)] >= self.depth[stage] + cap:
            return False
        return self.bytes[rank] + self.held[stage][0] <= self.budget[rank] + 1e-9 or not any(
            self.in_flight[(r, s)] for r, s in self.in_flight if r == rank
        )  # an empty rank always admits one

    def _blocked(self, rank: int) -> bool:
        """Whether a forward of `rank` waits for memory alone (a W would free some)."""
        return any(
            queue and not self._admits(rank, s)
            for (r, s), queue in self.forwards.items()
            if r == rank
        )

    # -- running an item ------------------------------------------------------------------

    def _run(self, rank: int, item: Item, start: float) -> None:
        kind, s, k = item
        seconds = self.times[s][(F, I, W).index(kind)]
        self.done[item] = start + seconds
        self.clock[rank] = start + seconds
        self.order[rank].append(item)
        full, kept = self.held[s]
        if kind == F:
            self.forwards[(rank, s)].popleft()
            self.inputs[rank].append((s, k))
            self.in_flight[(rank, s)] += 1
            self.bytes[rank] += full
        elif kind == I:
            self.inputs[rank].remove((s, k))
            self.weights[rank].append((s, k))
            self.bytes[rank] += kept - full
        else:
            self.weights[rank].popleft()
            self.in_flight[(rank, s)] -= 1
            self.bytes[rank] -= kept
