"""What a schedule is: the rules of one kind of pipeline schedule, in one object. Torch-free.

A schedule (a `PipelineSchedule` subclass registered by name, one file each in this package)
turns a plan's layout (the ranks of each stage, the stage pairs that exchange tensors, the
microbatches) into every rank's ordered actions (`builder.build_schedule`), and owns every rule
of its kind: the order of one replica's forwards and backwards (its warm-up), which microbatch
counts it accepts, whether its steps are synchronous or stream across calls with stashed weight
versions, which version a microbatch computes on, how its updates are clipped. Everything else
(memory in flight, step time, bubble, messages) is derived from the actions it builds
(`derived.py`, the simulator), never re-stated elsewhere. Nothing outside a schedule's own file
tests its name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from pdcompile.errors import ScheduleError

MAX_MICROBATCHES = 1 << 16  # a documented cap: plans and simulations of more are refused
SPLIT = 0.5  # a stage's input-gradient part I takes this share of its backward_s, W the rest


class MemoryCounts(NamedTuple):
    """Per replica of a stage, what the solvers charge: `in_flight` microbatches holding all
    their `activation_bytes`, `deferred` holding only `weight_grad_activation_bytes` (W
    pending), `versions` weight copies besides the live weights; of the microbatches, while
    the replica holds gradients (from its first backward to its update) at most
    `graded_in_flight` and `graded_deferred` (None: as many)."""

    in_flight: int
    deferred: int
    versions: int
    graded_in_flight: int | None = None
    graded_deferred: int | None = None

    @property
    def graded(self) -> tuple[Any, Any]:
        """(`graded_in_flight`, `graded_deferred`), None read as the counts of all."""
        held = self.in_flight if self.graded_in_flight is None else self.graded_in_flight
        return held, self.deferred if self.graded_deferred is None else self.graded_deferred

    def charges(self, weights: Any, grads: Any, params: Any, activations: Any, kept: Any) -> tuple:
        """The two bytes the peak is the larger of, for a stage's `weights` (parameters,
        gradients, optimizer state), `grads`, `params` (a weight copy), `activations` and
        `kept` (of them, held from I to W) per microbatch: without its gradients, every
        microbatch the counts allow; with them, those allowed while they are held. Numbers,
        arrays or linear expressions alike (the caller takes the maximum)."""
        held, waiting = self.graded
        fixed = weights + self.versions * params
        return (
            fixed - grads + self.in_flight * activations + self.deferred * kept,
            fixed + held * activations + waiting * kept,
        )


def split_parts(backward_s: float, weight_s: float | None = None) -> tuple[float, float]:
    """(I, W): the input- and weight-gradient parts of a fused backward of `backward_s`
    seconds, W being `weight_s` (None: the share 1 - `SPLIT`, as the simulator prices them)."""
    w = (1 - SPLIT) * backward_s if weight_s is None else weight_s
    return backward_s - w, w


class PipelineSchedule:
    """The rules of one schedule kind. Subclasses override what differs from these defaults
    (a synchronous schedule with PipeDream's warm-up: 1F1B's order).

    Attributes:
        name: the registered name (set by `register_schedule`).
        meaning: what one `train_step` does, for `PipelinedModule.explain()`.
        streaming: microbatches stay in flight across `train_step` calls (no flush between
            steps); each forward stashes a weight version (`push`) its backward drops (`pop`).
        update_per_microbatch: each microbatch is a minibatch with its own update (its loss is
            not weighted by its share of the batch; replicas average their gradients).
        vertical_sync: accepts `vertical_sync=True` (`weight_version` honours it).
        keeps_previous: an update first keeps a copy of the weights it changes (the next step
            computes on them: 2BW's two versions).
        replicates_ties: a stage holding a copy of a tied tensor may have several replicas.
    """

    name: str = ""
    meaning: str = ""
    streaming: bool = False
    update_per_microbatch: bool = False
    vertical_sync: bool = False
    keeps_previous: bool = False
    replicates_ties: bool = True

    @property
    def synchronous(self) -> bool:
        """One update per `train_step` from all its microbatches (so a step can be skipped on
        every rank, and clipping is global)."""
        return not self.streaming

    # -- microbatches ---------------------------------------------------------------------

    def check(
        self, replicas: Sequence[int], num_microbatches: int, ties: Sequence[Sequence[int]] = ()
    ) -> None:
        """Raise `ScheduleError` unless this schedule runs `num_microbatches` per step on
        stages with `replicas` (`ties`: per tied tensor, the stages using it)."""
        if not replicas or any(r < 1 for r in replicas):
            raise ScheduleError(f"replica counts must be >= 1 per stage, got {list(replicas)}")
        if not 1 <= num_microbatches <= MAX_MICROBATCHES:
            raise ScheduleError(
                f"num_microbatches must be between 1 and {MAX_MICROBATCHES}, got {num_microbatches}"
            )

    def accepts(self, replicas: Sequence[int], num_microbatches: int) -> bool:
        """Whether `check` passes."""
        try:
            self.check(replicas, num_microbatches)
        except ScheduleError:
            return False
        return True

    def accepted_microbatches(self, replicas: Sequence[int], at_least: int) -> int:
        """The first microbatch count from `at_least` on this schedule accepts for stages with
        `replicas` (`plan()` defaults to it from twice the devices).

        Raises:
            ScheduleError: it accepts none up to `MAX_MICROBATCHES`.
        """
        for m in range(max(1, at_least), MAX_MICROBATCHES + 1):
            if self.accepts(replicas, m):
                return m
        raise ScheduleError(
            f"{self.name} accepts no microbatch count from {max(1, at_least)} to "
            f"{MAX_MICROBATCHES} for stages with replicas {list(replicas)}; give fewer devices "
            "or another schedule"
        )

    # -- the order of one replica's compute ------------------------------------------------

    def warmup(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """Forwards a replica of `stage` runs before its first backward (PipeDream's rule:
        w_s = (sum_{t>=s} r_t - 1) // r_s)."""
        return (sum(replicas[stage:]) - 1) // replicas[stage]

    def compute_item(self, warmup: int, mine: Sequence[int], t: int) -> tuple[str, int]:
        """Item t (of `items_per_microbatch * len(mine)`) of one replica's compute for its
        microbatches `mine`: (kind, microbatch), kind "F", "B" or the split backward's "I"
        (input gradients) and "W" (weight gradients). Default: `warmup` forwards, then a
        forward and a backward alternately, then the remaining backwards. Computed, not
        listed: `mine` may be endless (a stream)."""
        n = len(mine)
        w = min(warmup, n)
        if t < w:
            return "F", mine[t]
        t -= w
        pairs = n - w  # backwards with a forward before them
        if t < 2 * pairs:
            return ("F", mine[t // 2 + w]) if t % 2 == 0 else ("B", mine[t // 2])
        return "B", mine[pairs + t - 2 * pairs]

    items_per_microbatch: int = 2  # F and B (3 with a split backward: F, I, W)

    def replica_order(
        self, replicas: Sequence[int], stage: int, num_microbatches: int, mine: Sequence[int]
    ) -> list[tuple[str, int]]:
        """A synchronous replica's whole compute for its microbatches `mine`, in order
        ((kind, microbatch) items). Default: `compute_item` over `warmup`; a schedule whose
        order needs more of the layout than the warm-up overrides this (streaming ones unfold
        `compute_item` lazily instead)."""
        w = self.warmup(replicas, stage, num_microbatches)
        count = self.items_per_microbatch * len(mine)
        return [self.compute_item(w, mine, t) for t in range(count)]

    def rank_orders(
        self, ranks: Sequence[Sequence[int]], num_microbatches: int
    ) -> dict[int, list[tuple[str, int, int]]] | None:
        """Every rank's compute in order, as (kind, stage, microbatch) items, for a schedule
        that orders the several stages of a rank itself (`interleaved-1f1b`, `zb-v`); None
        (the default): each replica keeps its own `replica_order`, and the builder merges the
        stages sharing a rank (`builder._merge`). `ranks`: per stage, its ranks."""
        return None

    def check_layout(self, ranks: Sequence[Sequence[int]], num_microbatches: int) -> None:
        """Raise `ScheduleError` unless this schedule runs on stages placed on `ranks` (per
        stage, its ranks) with `num_microbatches` (`check` sees only the replica counts)."""

    default_chunks: int = 1  # stages per rank `plan()` cuts for this schedule by default

    @property
    def auto_chunks(self) -> tuple[int, ...]:
        """The stages per rank `plan(..., schedule="auto")` tries this schedule with (default:
        its `default_chunks`)."""
        return (self.default_chunks,)

    def chunk_rank(self, stage: int, num_ranks: int, chunks: int) -> int:
        """The rank of `stage` when `plan(..., chunks=v)` puts v stages on each of `num_ranks`
        ranks: round-robin, stage i on rank i mod p (Megatron's virtual pipeline)."""
        return stage % num_ranks

    # -- updates and weight versions -------------------------------------------------------

    def round_size(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """Streaming: microbatches of `stage` per update (its replicas update together after
        their last backward of each round)."""
        return num_microbatches

    def weight_version(
        self, replicas: Sequence[int], stage: int, microbatch: int, num_microbatches: int,
        vertical: bool = False,
    ) -> int | None:  # fmt: skip
        """Streaming: the updates (counted from the stream's start; below 0: before it, clamped
        at 0 by the caller) in the weights `microbatch` computes on at `stage`, or None for
        the newest weights when its forward runs."""
        return None

    def version(
        self, replicas: Sequence[int], stage: int, minibatch: int, num_microbatches: int
    ) -> int:
        """Updates of `stage` in the weights minibatch `minibatch` runs on
        (`PipelinedModule.version`): synchronous, the steps before its own."""
        return minibatch // num_microbatches

    def clip_group(
        self, stage: int, ranks: Sequence[Sequence[int]], linked: frozenset[int],
        world: tuple[int, ...],
    ) -> tuple[int, ...]:  # fmt: skip
        """The ranks whose gradients share one norm when clipping `stage` (`linked`: the stages
        tied to it; `()`: the stage alone). Default: every rank (global clipping)."""
        return world

    # -- streams ---------------------------------------------------------------------------

    def lookahead(self, replicas: Sequence[int], num_microbatches: int) -> int:
        """Streaming: microbatches that every replica's warm-up fits in, a multiple of every
        replica count: after them the stream repeats."""
        deepest = max(self.warmup(replicas, s, num_microbatches) for s in range(len(replicas)))
        return math.lcm(*replicas) * (deepest + 1) * max(replicas)

    def steady_calls(self, replicas: Sequence[int], num_microbatches: int) -> int:
        """Streaming: `train_step` calls until one is in the steady state (every replica of
        stage s has had w_s + 1 microbatches before it starts)."""
        steady = max(
            r * (self.warmup(replicas, s, num_microbatches) + 1) for s, r in enumerate(replicas)
        )
        return -(-steady // num_microbatches) + 1

    # -- closed forms (fast search; checked against simulating the actions) -----------------

    def in_flight_bound(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """Microbatches whose activations a replica of `stage` holds at most: its warm-up and
        the one forward after it (a synchronous step: no more than it runs; a stream never
        drains, so its steady state holds them all)."""
        held = self.warmup(replicas, stage, num_microbatches) + 1
        return held if self.streaming else min(held, -(-num_microbatches // replicas[stage]))

    def stashed_versions_bound(
        self, replicas: Sequence[int], stage: int, num_microbatches: int
    ) -> int:
        """Weight copies a replica of `stage` keeps at most besides the live weights."""
        return 0

    def step_time(
        self, num_stages: int, num_microbatches: int, forward_s: float, backward_s: float,
        *, weight_s: float | None = None, chunks: int = 1,
    ) -> float:  # fmt: skip
        """Seconds of one `train_step` call on equal stages, one per rank, of `forward_s` and
        `backward_s` per microbatch (no communication, no runtime costs): (M + S - 1)(F + B)
        for a synchronous schedule, which fills and drains within the call; M (F + B) +
        (S - 1) F in a stream's steady state, which does not drain, but every call ends with
        the loss reaching every rank, so the next call's forwards refill the pipeline.

        The schedules that split the backward read `weight_s`, the weight-gradient part W of
        `backward_s` (None: half of it, the simulator's split: `split_parts`), and those with
        several stages per rank `chunks` (`num_stages` = chunks x ranks)."""
        if self.streaming:
            return num_microbatches * (forward_s + backward_s) + (num_stages - 1) * forward_s
        return (num_microbatches + num_stages - 1) * (forward_s + backward_s)

    def bubble(
        self, num_stages: int, num_microbatches: int, forward_s: float, backward_s: float,
        *, weight_s: float | None = None, chunks: int = 1,
    ) -> float:  # fmt: skip
        """The idle share of that call on every rank: 1 - chunks M (F + B) / step_time."""
        step = self.step_time(num_stages, num_microbatches, forward_s, backward_s,
                              weight_s=weight_s, chunks=chunks)  # fmt: skip
        work = chunks * num_microbatches * (forward_s + backward_s)
        return 1 - work / step if step else 0.0

    def __repr__(self) -> str:
        return f"<schedule {self.name!r}>"

    # -- bounds for solvers ----------------------------------------------------------------

    def defer(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """W's (weight gradients) a replica of `stage` leaves waiting behind its I's, for a
        schedule that splits the backward (`zb-h1`, `zb-h2`); none by default."""
        return 0

    def deferred_bound(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """Of the `in_flight_bound` microbatches, those a replica of `stage` may hold with only
        their W left to run, keeping `weight_grad_activation_bytes` of their activations:
        `defer`, at most the replica's microbatches beyond its warm-up and one forward (so that
        `in_flight_bound` - this is min(its warm-up + 1, its microbatches) whose I is
        pending)."""
        mine = -(-num_microbatches // replicas[stage])
        held = self.warmup(replicas, stage, num_microbatches) + 1
        return min(self.defer(replicas, stage, num_microbatches), max(0, mine - held))

    def memory_counts(
        self, stages_from_here: int, warmup: int, num_microbatches: int, deepest: int
    ) -> MemoryCounts:
        """What the solvers charge a replica whose PipeDream warm-up is `warmup` (w, at least
        its layout's) in a pipeline whose deepest PipeDream warm-up is `deepest` (at least its
        layout's): the closed forms at the stage of warm-up w of a straight pipeline of
        max(deepest, w) + 1 stages (the W's a split schedule leaves pending grow with the
        deepest): `in_flight_bound` - `deferred_bound`, `deferred_bound`,
        `stashed_versions_bound`. A replica of r > 1 runs M / r of the M microbatches, so they
        bound it too. in_flight, in_flight + deferred and versions are non-decreasing in w and
        `deepest`, and so are the bytes (a deferred microbatch keeps at most what one in flight
        does). `stages_from_here` is there for schedules that need it."""
        straight = [1] * (max(deepest, warmup) + 1)
        stage = len(straight) - 1 - warmup
        deferred = self.deferred_bound(straight, stage, num_microbatches)
        in_flight = self.in_flight_bound(straight, stage, num_microbatches) - deferred
        graded = self.graded_counts(straight, stage, num_microbatches)
        return MemoryCounts(
            in_flight,
            deferred,
            self.stashed_versions_bound(straight, stage, num_microbatches),
            min(graded[0], in_flight),
            min(graded[0] + graded[1], in_flight + deferred) - min(graded[0], in_flight),
        )

    def graded_counts(
        self, replicas: Sequence[int], stage: int, num_microbatches: int
    ) -> tuple[int, int]:
        """(all, W pending): the microbatches a replica of `stage` may hold at once while it
        holds gradients (they appear at the end of its first B or W and go at the update), as
        the simulator holds them. A synchronous replica's own order is walked (the first
        count the largest such, the second what the largest total adds to it); a stream never
        drains: the in-flight bound, one less where each backward is followed by its update
        before the next forward (a round of one microbatch). A schedule that does not run
        the layout with one stage per rank (`zb-v`) gets the bounds of all."""
        held = self.in_flight_bound(replicas, stage, num_microbatches)
        if self.streaming:
            alone = self.round_size(replicas, stage, num_microbatches) == 1
            return held - alone, 0
        try:
            self.check_layout([(r,) for r in range(len(replicas))], num_microbatches)
        except ScheduleError:
            deferred = self.deferred_bound(replicas, stage, num_microbatches)
            return held - deferred, deferred
        mine = range(-(-num_microbatches // replicas[stage]))
        full = waiting = most = most_total = 0
        graded = False
        for kind, _ in self.replica_order(replicas, stage, num_microbatches, mine):
            full += (kind == "F") - (kind in ("B", "I"))
            waiting += (kind == "I") - (kind == "W")
            graded = graded or kind in ("B", "W")
            if graded:
                most, most_total = max(most, full), max(most_total, full + waiting)
        return most, most_total - most

    def memory_bounds(
        self, devices_from_here: int, replicas: int, num_microbatches: int, num_devices: int
    ) -> MemoryCounts:
        """`memory_counts` at least as large as for any layout of the other stages (for a
        search that has not placed the later ones and does not keep the earlier ones): a stage
        with `replicas` and `devices_from_here` of a pipeline's at most `num_devices` devices
        from its first rank on has at most devices_from_here - replicas + 1 stages from here
        and a warm-up of at most (devices_from_here - 1) // replicas; the pipeline's deepest is
        at most num_devices - 1 (a first stage on one rank) or, the stage being the first, the
        larger of its own and devices_from_here - replicas - 1 (a later stage's)."""
        warmup = (devices_from_here - 1) // replicas
        first = devices_from_here >= num_devices
        deepest = devices_from_here - replicas - 1 if first else num_devices - 1
        return self.memory_counts(
            devices_from_here - replicas + 1, warmup, num_microbatches, deepest
        )
