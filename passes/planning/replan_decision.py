"""The closed loop: re-plan from what the stages measured. Torch-free.

A running job (`compile(..., replan=True)`) and a recorded one (`pdcompile plan --measured
TRACE`) take the same three steps:
1. `measured_stage_times`: per stage, the median seconds of a microbatch's forward and of its
   backward (B, or I + W of the same microbatch) over the recorded actions;
2. `rescaled`: the CostGraph with every node of a stage scaled so that the stage's forward and
   backward, priced as the plan priced them (at its rows per microbatch), equal the measured
   ones (what the plan priced besides the nodes, e.g. the loss, stays); a node's times at
   every profiled row count (`row_s`) scale by the same factors;
3. `decide`: the plan made anew on those costs (same solver, schedule, microbatches, cluster)
   against the running plan re-scored on them (same partition): move when the new one is
   predicted at least `threshold` faster per step.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import CheckpointError, PartitionError
from pdcompile.core.text import human_seconds
from pdcompile.passes.planning.evaluation import evaluate
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.stage_sums import node_sums
from pdcompile.scheduling.action_kinds import is_compute
from pdcompile.scheduling.action_kinds import kind as action_kind

FLOOR = 0.05  # a stage's nodes are never priced below this share of what the profile said


@dataclass(frozen=True)
class Replan:
    """When and how `compile(..., replan=...)` re-plans a running job (`replan=True`: these
    defaults).

    Attributes:
        after_steps: train steps measured before deciding (the first is left out of the
            measurement when there are several: it pays one-off allocations).
        threshold: the new plan must be predicted at least this share faster per step.
        directory: where the running plan's checkpoint is written before the move (it stays
            whole if a rank dies during the move); None: a fresh temporary folder, which under
            torch.distributed must be one every rank sees (one host).
        timeline: a function returning the actions to measure instead of the recorded ones
            (`Event`s of any ranks; each rank keeps its own): a recorded run replayed
            (`runtime.timeline.load_trace`), or synthetic times in tests.
    """

    after_steps: int = 3
    threshold: float = 0.10
    directory: str | None = None
    timeline: Callable[[], Sequence[Any]] | None = None

    def __post_init__(self) -> None:
        steps = self.after_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise PartitionError(f"Replan.after_steps must be an integer >= 1 (train steps "
                                 f"measured before deciding), got {steps!r}")  # fmt: skip
        share = self.threshold
        number = isinstance(share, (int, float)) and not isinstance(share, bool)
        if not (number and math.isfinite(share) and 0 <= share < 1):
            raise PartitionError(f"Replan.threshold must be a number in [0, 1) (e.g. 0.1: the new "
                                 f"plan 10% faster), got {share!r}")  # fmt: skip
        if self.timeline is not None and not callable(self.timeline):
            raise PartitionError(f"Replan.timeline must be a function returning events or None, "
                                 f"got {type(self.timeline).__name__}")  # fmt: skip
        if self.directory is not None:
            object.__setattr__(self, "directory", _checked_directory(self.directory))


def _checked_directory(directory: Any) -> str:
    """`Replan.directory` as a path a move can save into (checked now, not at the move).

    Raises:
        CheckpointError: not a path, empty, or a file (a folder holding other files is refused
            when the `Replanner` is made: `move.check_folder`).
    """
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise CheckpointError(f"Replan.directory must be a folder's path (str) or None (a fresh "
                              f"temporary folder), got {directory!r}")  # fmt: skip
    path = os.fspath(directory)
    if not isinstance(path, str):
        raise CheckpointError(f"Replan.directory must be a text path, got {directory!r}")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointError(
            f"Replan.directory={path!r} is a file: the move checkpoints the running plan into a "
            "folder; give a new folder's path, or None"
        )
    return path


@dataclass(frozen=True)
class StageTime:
    """A stage's measured seconds per microbatch (medians), and how many microbatches."""

    forward_s: float
    backward_s: float
    count: int


@dataclass(frozen=True)
class Decision:
    """What `decide` found: the running plan and the new one, both priced on the measured
    costs; `move` whether the new one is fast enough to move to, `reason` why (not)."""

    running: Plan
    new: Plan
    measured: Mapping[int, StageTime]
    move: bool
    reason: str

    @property
    def gain(self) -> float:
        """The share of the running plan's step time the new plan saves (predicted)."""
        return 1 - self.new.step_time / self.running.step_time if self.running.step_time else 0.0

    def describe(self) -> str:
        """A few lines for `explain()` and the CLI."""
        lines = [
            f"re-planned from measured stage times: {self.reason}",
            f"  running plan on the measured costs: step {human_seconds(self.running.step_time)}"
            f", stages {_shape(self.running)}",
            f"  new plan: step {human_seconds(self.new.step_time)} ({self.gain:+.1%} saved), "
            f"stages {_shape(self.new)}",
        ]
        for s, t in sorted(self.measured.items()):
            planned = self.running.stages[s] if s < self.running.num_stages else None
            lines.append(
                f"  stage {s}: measured forward {human_seconds(t.forward_s)}, backward "
                f"{human_seconds(t.backward_s)} per microbatch ({t.count} microbatches)"
                + (f", after re-pricing {human_seconds(planned.forward_s)} / "
                   f"{human_seconds(planned.backward_s)}" if planned else "")
            )  # fmt: skip
        return "\n".join(lines)


def _shape(plan: Plan) -> str:
    return " | ".join(f"{len(s.nodes)} nodes x{s.replicas}" for s in plan.stages)


def measured_stage_times(events: Iterable[Any]) -> dict[int, StageTime]:
    """Per stage, the medians over microbatches of its forward and its backward seconds (a split
    backward's I and the W that follows it for the same microbatch summed; microbatch numbers
    repeat from step to step), from timeline events (`Event`s: `kind`, `stage`, `microbatch`,
    `rank`, `start`, `end`). Replicas count alike."""
    forward: dict[int, list[float]] = {}
    backward: dict[int, list[float]] = {}
    waiting: dict[tuple[int, int, int], int] = {}  # an I's place in `backward`, until its W
    computed = [e for e in events if is_compute(_checked(e).kind) and e.microbatch >= 0]
    for e in sorted(computed, key=lambda e: e.start):
        seconds, key, row = e.end - e.start, (e.stage, e.rank, e.microbatch), action_kind(e.kind)
        if row.starts:
            forward.setdefault(e.stage, []).append(seconds)
            continue
        mine = backward.setdefault(e.stage, [])
        if row.ends and key in waiting:  # the last part of a backward begun earlier (W)
            mine[waiting.pop(key)] += seconds
            continue
        if not row.ends:  # a first part (I): the part that ends the microbatch adds to it
            waiting[key] = len(mine)
        mine.append(seconds)
    return {
        s: StageTime(statistics.median(forward[s]), statistics.median(backward[s]), len(forward[s]))
        for s in sorted(forward)
        if s in backward
    }


def _checked(event: Any) -> Any:
    """`event` if its fields are what a recorded action has, else `PartitionError` naming it."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    fields = [getattr(event, k, None) for k in ("kind", "stage", "microbatch", "start", "end")]
    kind, stage, microbatch, start, end = fields
    problem = None
    if not (isinstance(kind, str) and whole(stage) and whole(microbatch)):
        problem = "its kind is no text, or its stage or microbatch no integer"
    elif is_compute(kind) and microbatch >= 0:
        if not (number(start) and number(end) and math.isfinite(start) and math.isfinite(end)):
            problem = "its start or end is no finite number of seconds"
        elif end < start:
            problem = f"it ends {start - end:.3g} s before it starts (a negative duration)"
        elif stage < 0:
            problem = "its stage is negative"
    if problem:
        raise PartitionError(
            f"a measured action cannot be used: {problem} ({event!r}); measure with "
            "PipelinedModule.save_trace, or give Replan.timeline events of that form"
        )
    return event


def check_measured(cost_graph: CostGraph, plan: Plan, measured: Mapping[int, StageTime]) -> None:
    """Raise `PartitionError` unless `measured` times every stage of `plan`, and `plan`'s
    stages hold exactly `cost_graph`'s nodes (a trace of another model's run holds another)."""
    nodes = [n for s in plan.stages for n in s.nodes]
    unknown = [n for n in nodes if n not in cost_graph.graph]
    unplanned = [n for n in cost_graph.graph if n not in set(nodes)]
    if unknown or unplanned:
        parts = [f"hold {len(unknown)} nodes the graph lacks, e.g. {unknown[:3]}"] * bool(unknown)
        parts += [f"miss {len(unplanned)} of its nodes, e.g. {unplanned[:3]}"] * bool(unplanned)
        raise PartitionError(
            f"the running plan is not a plan of this cost graph: its stages {' and '.join(parts)}"
            "; measure a run of this model, or give its costs (the CostGraph its plan was made "
            "from)"
        )
    missing = [s.index for s in plan.stages if s.index not in measured]
    extra = sorted(s for s in measured if not 0 <= s < plan.num_stages)
    if missing or extra:
        raise PartitionError(
            f"the measured actions time stages {sorted(measured)}, but the plan has stages "
            f"0 to {plan.num_stages - 1}"
            + (f": no forward and backward of stages {missing}" if missing else "")
            + (f": stages {extra} are not the plan's" if extra else "")
            + "; measure every rank's actions of a run of this plan (save_trace on every rank)"
        )


def rescaled(cost_graph: CostGraph, plan: Plan, measured: Mapping[int, StageTime]) -> CostGraph:
    """`cost_graph` with the nodes of each measured stage of `plan` scaled: forward times by one
    factor, backward times (and their I and W parts) by another, so that the stage priced as
    `plan` prices it (at its `microbatch_size` rows, on its devices) takes the measured seconds.

    Raises:
        PartitionError: `plan` is not a plan of this graph, or a stage it names is missing.
    """
    rows = plan.microbatch_size or cost_graph.batch_size
    # the nodes as the plan priced them: at its rows, on their curves (CostGraph.scaled)
    priced = cost_graph.scaled(rows) if rows and rows != cost_graph.batch_size else cost_graph
    factors: dict[str, tuple[float, float]] = {}
    for s, seen in measured.items():
        if s >= plan.num_stages:
            raise PartitionError(f"measured stage {s}, but the plan has {plan.num_stages} stages")
        stage = plan.stages[s]
        speed = plan.cluster.device_speed(stage.ranks)
        sums = node_sums(priced, stage.nodes)
        nodes_f, nodes_b = sums.forward_s / speed, sums.backward_s / speed
        # what the plan priced besides the nodes (e.g. the loss) is not the nodes' to absorb
        f = _factor(seen.forward_s - (stage.forward_s - nodes_f), nodes_f)
        b = _factor(seen.backward_s - (stage.backward_s - nodes_b), nodes_b)
        factors.update(dict.fromkeys(stage.nodes, (f, b)))
    out = cost_graph.copy()
    for node, (f, b) in factors.items():
        data = out.graph.nodes[node]
        data["forward_s"] *= f
        for name in ("backward_s", "backward_input_s", "backward_weight_s"):
            data[name] *= b
        if data["row_s"] is not None:  # the curve scaled alike: its shape is the profile's
            data["row_s"] = tuple((p[0] * f, p[1] * b, p[2] * b, p[3] * b) for p in data["row_s"])
    out.meta = {**out.meta, "rescaled": "node times scaled to measured stage times"}
    return out


def _factor(measured: float, predicted: float) -> float:
    return max(measured / predicted, FLOOR) if predicted > 0 else 1.0


def decide(
    cost_graph: CostGraph,
    plan: Plan,
    measured: Mapping[int, StageTime],
    *,
    threshold: float = Replan.threshold,
    **options: Any,
) -> Decision:
    """The running `plan` and a new one, both on the costs the stages measured (`rescaled`);
    move when the new plan's `step_time` is at most (1 - threshold) of the running one's and
    it uses as many devices (a job keeps its ranks). `options`: `plan()`'s (solver, schedule,
    ...; default: the running plan's); the microbatch count and size and the cluster are the
    running plan's.

    Raises:
        PartitionError: `measured` misses a stage of `plan` or names one it lacks, or `plan`
            is not a plan of `cost_graph` (`check_measured`); no new plan exists.
    """
    from pdcompile.passes.planning.planner import plan as make_plan

    check_measured(cost_graph, plan, measured)
    costs = rescaled(cost_graph, plan, measured)
    rows = plan.microbatch_size or cost_graph.batch_size
    priced = costs.scaled(rows) if rows and rows != costs.batch_size else costs
    running = evaluate(plan, priced)
    options = {"solver": plan.solver or "dynprog", "schedule": plan.schedule, **options}
    new = make_plan(costs, plan.cluster, num_microbatches=plan.num_microbatches,
                    microbatch_size=rows, **options)  # fmt: skip
    gain = 1 - new.step_time / running.step_time if running.step_time else 0.0
    if [(s.nodes, s.ranks) for s in new.stages] == [(s.nodes, s.ranks) for s in plan.stages]:
        return Decision(running, new, measured, False, "the same plan is still the best")
    if new.num_devices_used != plan.num_devices_used:
        return Decision(running, new, measured, False,
                        f"the new plan uses {new.num_devices_used} devices, the job runs "
                        f"{plan.num_devices_used}: staying")  # fmt: skip
    if not new.fits_memory:
        return Decision(running, new, measured, False, "the new plan does not fit memory")
    if gain < threshold:
        return Decision(running, new, measured, False,
                        f"predicted {gain:.1%} faster, below the threshold {threshold:.0%}: "
                        "staying")  # fmt: skip
    return Decision(running, new, measured, True,
                    f"predicted {gain:.1%} faster (threshold {threshold:.0%}): moving")  # fmt: skip
