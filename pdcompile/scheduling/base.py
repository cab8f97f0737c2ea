"""What a schedule is: a narrow contract, one object per kind. Torch-free.

A schedule (a `PipelineSchedule` subclass registered by name, one file each in this package)
has a required core and two optional parts:

- the core: its `name` (given by `register_schedule`), what it accepts (`check`,
  `check_layout`: the microbatch counts and layouts it runs), every rank's order of compute
  items (`rank_orders`, the one method without a default) and where its stages sit
  (`chunk_rank`, `default_chunks`, `auto_chunks`);
- a weight policy (`weights`, a `WeightPolicy`: streaming, weight versions, round size, clip
  group), synchronous by default;
- closed forms (`closed_forms`, a `ClosedForms`: step time, bubble, memory counts on equal
  stages), none by default: the memory counts are then derived by walking its orders, and a
  subclass never inherits another kind's formulas.

Everything else is derived here from those, and never overridden: the accepted microbatch
counts, the streams' look-ahead, the solvers' memory counts, and, in the builder and the
simulator, every rank's actions, memory in flight, step time and bubble. Nothing outside a
schedule's own file tests its name; the kinds of actions are in `action_kinds.py`.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, final

from pdcompile.core.errors import ScheduleError
from pdcompile.scheduling.action_kinds import compute_kinds
from pdcompile.scheduling.closed_forms import SPLIT, ClosedForms, split_parts
from pdcompile.scheduling.memory_walk import Walked, walks
from pdcompile.scheduling.placement import Item, Placement
from pdcompile.scheduling.weight_policy import SYNCHRONOUS, WeightPolicy

__all__ = ["MAX_MICROBATCHES", "SPLIT", "MemoryCounts", "PipelineSchedule", "split_parts"]

MAX_MICROBATCHES = 1 << 16  # a documented cap: plans and simulations of more are refused
# the weight policy's names: a schedule gives them in its `weights`, not as its own attributes
POLICY = ("streaming", "update_per_microbatch", "vertical_sync", "keeps_previous",
          "replicates_ties", "round_size", "weight_version", "version", "clip_group")  # fmt: skip


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


class PipelineSchedule(abc.ABC):
    """The rules of one schedule kind: a required core, an optional weight policy and optional
    closed forms (docs in the module).

    Attributes:
        name: the registered name (set by `register_schedule`).
        meaning: what one `train_step` does, for `PipelinedModule.explain()`.
        items_per_microbatch: compute items per microbatch and stage in its orders: 2 (F, B)
            or 3 (F and a split backward's I and W: `action_kinds.compute_kinds`).
        default_chunks: stages per rank `plan()` cuts for this schedule by default.
        weights: its weight policy (default: synchronous).
        closed_forms: its formulas, or None (derived by walking its orders).
    """

    name: str = ""
    meaning: str = ""
    items_per_microbatch: int = 2
    default_chunks: int = 1
    weights: WeightPolicy = SYNCHRONOUS
    closed_forms: ClosedForms | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "closed_forms" not in vars(cls):
            cls.closed_forms = None  # a kind's formulas are its own: never inherited
        given = [n for n in POLICY if n in vars(cls)]
        if given:
            raise ScheduleError(
                f"{cls.__name__} defines {', '.join(given)}: a schedule's weight rules belong "
                "in its weight policy; subclass pdcompile.scheduling.WeightPolicy and set "
                "`weights = YourPolicy()` on the schedule"
            )

    # -- the required core --------------------------------------------------------------------

    @abc.abstractmethod
    def rank_orders(self, placement: Placement) -> Mapping[int, Sequence[Item]]:
        """Every rank's compute in order, as (kind, stage, microbatch) items over the stages
        of `placement` it runs a replica of: each of its microbatches (`placement.mine`) of
        each of those stages once per compute kind (`compute_kinds`; a split kind may run some
        backwards fused, `action_kinds.ways`; an `FB` bracket may pair two items), in an order the
        messages allow (a forward after the forwards feeding it, a backward after those it
        receives gradients from). A streaming schedule's orders may be endless (`total` is
        `ENDLESS`): any `Sequence` computing its items when indexed."""

    def check(
        self, replicas: Sequence[int], num_microbatches: int, ties: Sequence[Sequence[int]] = ()
    ) -> None:
        """Raise `ScheduleError` unless this schedule runs `num_microbatches` per step on
        stages with `replicas` (`ties`: per tied tensor, the stages using it). Default: any
        count from 1 to `MAX_MICROBATCHES`."""
        if not replicas or any(r < 1 for r in replicas):
            raise ScheduleError(f"replica counts must be >= 1 per stage, got {list(replicas)}")
        if not 1 <= num_microbatches <= MAX_MICROBATCHES:
            raise ScheduleError(
                f"num_microbatches must be between 1 and {MAX_MICROBATCHES}, got {num_microbatches}"
            )

    def check_layout(  # noqa: B027 (a default: any placement)
        self, ranks: Sequence[Sequence[int]], num_microbatches: int
    ) -> None:
        """Raise `ScheduleError` unless this schedule runs on stages placed on `ranks` (per
        stage, its ranks) with `num_microbatches` (`check` sees only the replica counts).
        Default: any placement."""

    @property
    def auto_chunks(self) -> tuple[int, ...]:
        """The stages per rank `plan(..., schedule="auto")` tries this schedule with (default:
        its `default_chunks`)."""
        return (self.default_chunks,)

    def chunk_rank(self, stage: int, num_ranks: int, chunks: int) -> int:
        """The rank of `stage` when `plan(..., chunks=v)` puts v stages on each of `num_ranks`
        ranks: round-robin, stage i on rank i mod p (Megatron's virtual pipeline)."""
        return stage % num_ranks

    @final
    @property
    def fits_plans(self) -> bool:
        """Whether the kind fits its orders to each plan (it overrides `for_plan`):
        `schedule="auto"` then fits it to its best plan instead of planning it as a
        candidate."""
        return type(self).for_plan is not PipelineSchedule.for_plan

    def for_plan(self, options: Mapping[str, Any]) -> PipelineSchedule:
        """This kind as a plan with `options` runs it (`Plan.rules`): itself, unless its
        orders are fitted to each plan and the plan's options hold the fitting (`synth`)."""
        return self

    def __repr__(self) -> str:
        return f"<schedule {self.name!r}>"

    # -- derived: what it accepts -------------------------------------------------------------

    @final
    @property
    def compute_kinds(self) -> tuple[str, ...]:
        """The compute kinds of its orders (`action_kinds.FUSED` or `SPLIT`)."""
        return compute_kinds(self.items_per_microbatch)

    @final
    def accepts(self, replicas: Sequence[int], num_microbatches: int) -> bool:
        """Whether `check` passes."""
        try:
            self.check(replicas, num_microbatches)
        except ScheduleError:
            return False
        return True

    @final
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

    # -- derived: the weight policy, read where the callers have replicas --------------------

    @final
    @property
    def streaming(self) -> bool:
        return self.weights.streaming

    @final
    @property
    def synchronous(self) -> bool:
        """One update per `train_step` from all its microbatches (so a step can be skipped on
        every rank, and clipping is global)."""
        return not self.weights.streaming

    @final
    @property
    def update_per_microbatch(self) -> bool:
        return self.weights.update_per_microbatch

    @final
    @property
    def vertical_sync(self) -> bool:
        return self.weights.vertical_sync

    @final
    @property
    def keeps_previous(self) -> bool:
        return self.weights.keeps_previous

    @final
    @property
    def replicates_ties(self) -> bool:
        return self.weights.replicates_ties

    @final
    def round_size(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """`weights.round_size` of `stage` among stages with `replicas`."""
        return self.weights.round_size(_straight(tuple(replicas), num_microbatches), stage)

    @final
    def weight_version(
        self, replicas: Sequence[int], stage: int, microbatch: int, num_microbatches: int,
        vertical: bool = False,
    ) -> int | None:  # fmt: skip
        """`weights.weight_version` of `microbatch` at `stage` among stages with `replicas`."""
        placement = _straight(tuple(replicas), num_microbatches)
        return self.weights.weight_version(placement, stage, microbatch, vertical)

    @final
    def version(
        self, replicas: Sequence[int], stage: int, minibatch: int, num_microbatches: int
    ) -> int:
        """`weights.version`: updates of `stage` in the weights `minibatch` runs on."""
        placement = _straight(tuple(replicas), num_microbatches)
        return self.weights.version(placement, stage, minibatch)

    # -- derived: streams ---------------------------------------------------------------------

    @final
    def warmups(self, replicas: Sequence[int], num_microbatches: int) -> list[int]:
        """Per stage, the forwards a replica runs before the one its first backward follows
        (a stream's warm-up w_s), read off its order (a stream's: the endless one) on stages
        with `replicas`."""
        walked = walks(self, tuple(replicas), num_microbatches, 1)
        if walked is None:
            return [0] * len(replicas)
        return [max(0, held.warmup - 1) for held in walked]

    @final
    def lookahead(self, replicas: Sequence[int], num_microbatches: int) -> int:
        """Streaming: microbatches that every replica's warm-up fits in, a multiple of every
        replica count: after them the stream repeats."""
        deepest = max(self.warmups(replicas, num_microbatches))
        return math.lcm(*replicas) * (deepest + 1) * max(replicas)

    @final
    def steady_calls(self, replicas: Sequence[int], num_microbatches: int) -> int:
        """Streaming: `train_step` calls until one is in the steady state (`weights`)."""
        placement = _straight(tuple(replicas), num_microbatches)
        return self.weights.steady_calls(placement, self.warmups(replicas, num_microbatches))

    # -- derived: closed forms where given, else walked orders --------------------------------

    @final
    def step_time(
        self, num_stages: int, num_microbatches: int, forward_s: float, backward_s: float,
        *, weight_s: float | None = None, chunks: int = 1,
    ) -> float:  # fmt: skip
        """Seconds of one `train_step` call on equal stages of `forward_s` and `backward_s`
        per microbatch, `chunks` per rank (no communication, no runtime costs): the kind's
        closed form (`closed_forms.step_time`; `weight_s`: W's part of the backward).

        Raises:
            ScheduleError: the kind gives no closed form (simulate the plan instead).
        """
        form = self._form("step_time")
        return form(self, num_stages, num_microbatches, forward_s, backward_s,
                    weight_s=weight_s, chunks=chunks)  # fmt: skip

    @final
    def bubble(
        self, num_stages: int, num_microbatches: int, forward_s: float, backward_s: float,
        *, weight_s: float | None = None, chunks: int = 1,
    ) -> float:  # fmt: skip
        """The idle share of that call on every rank: the kind's form, or
        1 - chunks M (F + B) / step_time."""
        forms = self.closed_forms
        if forms is not None and forms.bubble is not None:
            return forms.bubble(self, num_stages, num_microbatches, forward_s, backward_s,
                                weight_s=weight_s, chunks=chunks)  # fmt: skip
        step = self.step_time(num_stages, num_microbatches, forward_s, backward_s,
                              weight_s=weight_s, chunks=chunks)  # fmt: skip
        work = chunks * num_microbatches * (forward_s + backward_s)
        return 1 - work / step if step else 0.0

    @final
    def in_flight_bound(
        self, replicas: Sequence[int], stage: int, num_microbatches: int, *, chunks: int = 1
    ) -> int:
        """Microbatches whose activations a replica of `stage` holds at most (counting those
        whose W alone is pending; with chunks > 1, microbatch-chunks of the rank running
        `stage`, all its stages together): the kind's form, or its walked orders (a stream's
        steady state), or, for a layout it does not run, every microbatch of the replica."""
        forms = self.closed_forms
        if forms is not None and forms.in_flight is not None:
            return forms.in_flight(self, replicas, stage, num_microbatches, chunks=chunks)
        held = self._held(replicas, stage, num_microbatches, chunks)
        if held is None:
            return chunks * -(-num_microbatches // replicas[stage])
        return held.in_flight

    @final
    def deferred_bound(self, replicas: Sequence[int], stage: int, num_microbatches: int) -> int:
        """Of the `in_flight_bound` microbatches, those a replica of `stage` may hold with only
        their W left to run, keeping `weight_grad_activation_bytes` of their activations: the
        kind's form, or what its walked orders leave beside the most holding all their
        activations."""
        forms = self.closed_forms
        if forms is not None and forms.deferred is not None:
            return forms.deferred(self, replicas, stage, num_microbatches)
        held = self._held(replicas, stage, num_microbatches, 1)
        if held is None:
            return 0
        return max(0, self.in_flight_bound(replicas, stage, num_microbatches) - held.full)

    @final
    def stashed_versions_bound(
        self, replicas: Sequence[int], stage: int, num_microbatches: int
    ) -> int:
        """Weight copies a replica of `stage` keeps at most besides the live weights
        (`weights.stashed_versions` of its `in_flight_bound`)."""
        in_flight = self.in_flight_bound(replicas, stage, num_microbatches)
        placement = _straight(tuple(replicas), num_microbatches)
        return self.weights.stashed_versions(placement, stage, in_flight)

    @final
    def graded_counts(
        self, replicas: Sequence[int], stage: int, num_microbatches: int
    ) -> tuple[int, int]:
        """(all, W pending): the microbatches a replica of `stage` may hold at once while it
        holds gradients (they appear at the end of its first B or W and go at the update),
        read off its walked order (the first count the largest such, the second what the
        largest total adds to it). A layout the kind does not run with one stage per rank
        (`zb-v`) gets the bounds of all."""
        held = self._held(replicas, stage, num_microbatches, 1)
        if held is None:
            deferred = self.deferred_bound(replicas, stage, num_microbatches)
            return self.in_flight_bound(replicas, stage, num_microbatches) - deferred, deferred
        return held.graded_full, held.graded_in_flight - held.graded_full

    @final
    def memory_counts(
        self, stages_from_here: int, warmup: int, num_microbatches: int, deepest: int
    ) -> MemoryCounts:
        """What the solvers charge a replica whose PipeDream warm-up is `warmup` (w, at least
        its layout's) in a pipeline whose deepest PipeDream warm-up is `deepest` (at least its
        layout's): the counts at the stage of warm-up w of a straight pipeline of
        max(deepest, w) + 1 stages (the W's a split schedule leaves pending grow with the
        deepest): `in_flight_bound` - `deferred_bound`, `deferred_bound`,
        `stashed_versions_bound`, and `graded_counts`. A replica of r > 1 runs M / r of the
        M microbatches, so they bound it too. in_flight, in_flight + deferred and versions are
        non-decreasing in w and `deepest`, and so are the bytes (a deferred microbatch keeps
        at most what one in flight does). `stages_from_here` is there for a schedule that
        overrides this with counts that need it."""
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

    @final
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

    # -- the walks --------------------------------------------------------------------------

    def _form(self, name: str) -> Any:
        form = getattr(self.closed_forms, name, None)
        if form is None:
            raise ScheduleError(
                f"{self.name or type(self).__name__} gives no closed form of its "
                f"{name.replace('_', ' ')}; simulate a plan of equal stages instead "
                "(pdcompile.simulate)"
            )
        return form

    def _held(
        self, replicas: Sequence[int], stage: int, num_microbatches: int, chunks: int
    ) -> Walked | None:
        """The most a replica of `stage` holds (the most of its replicas; with chunks > 1, of
        the rank running it), walked; None where the kind does not run that layout."""
        walked = walks(self, tuple(replicas), num_microbatches, chunks)
        return None if walked is None else walked[stage]


@functools.lru_cache(maxsize=1024)
def _straight(replicas: tuple[int, ...], num_microbatches: int) -> Placement:
    """`Placement.straight`, for the callers that give replica counts (the weight policy's
    rules, asked per microbatch)."""
    return Placement.straight(replicas, num_microbatches)
