"""Plans: which nodes form each pipeline stage, on how many replicas and which ranks. Torch-free.

A Plan is what a solver returns and what code generation and the runtime consume: stages in
pipeline order (each with its nodes, replica count, ranks and predicted costs), the cluster and
schedule it was made for, and what the cost model predicted. JSON in and out, printable as a table.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from pdcompile.core.cluster import Cluster
from pdcompile.core.errors import PartitionError, ScheduleError
from pdcompile.core.regular_file import read_regular_text
from pdcompile.core.text import human_bytes, human_seconds
from pdcompile.passes.planning.replica_splits import UnevenSplit, replica_split
from pdcompile.scheduling import PipelineSchedule, get_schedule

FORMAT = "pdcompile.passes.planning.plans"
VERSION = 1
INT64 = 2**63  # a plan file's integers are below this (what its readers hold)
SIGNED = ("gap", "rank_idle")  # the plan's only numbers that may be negative (by rounding)
# old solver names -> the registered ones (a saved plan's `solver` reads as the new name):
# "dp" read as "data parallel", so PipeDream's dynamic program is "dynprog"
RENAMED_SOLVERS = {"dp": "dynprog"}


@dataclass(frozen=True)
class Stage:
    """One pipeline stage. Times are seconds per minibatch (the CostGraph's batch) on one replica
    set: `time_s = compute / replicas + comm_s + allreduce_s` (docs/cost_model.md).

    The byte counts (per minibatch where they scale with it) are what `pdcompile.simulate` needs:
    `recv_bytes` pairs (earlier stage, bytes it sends here), of which the stages in
    `no_grad_from` get no gradients back (their tensors do not require grad: integer ids, masks),
    `activation_bytes` are kept from a forward to its backward, `weight_bytes` are parameters +
    gradients + optimizer state, in `param_tensors` parameter tensors (copies of tied ones
    included). `memory_bytes`: the peak of the stage's own share of its rank (simulated).

    A split backward (`zb-*` schedules) runs `backward_input_s` (I: the gradients of the stage's
    inputs, sent back at once) and later `backward_weight_s` (W: its weight gradients), each the
    sum of its nodes' (docs/cost_graph.md; measured apart, they need not add up to
    `backward_s`); of `activation_bytes`, `weight_grad_activation_bytes` stay from I to W. Left
    out (plans of an older pdcompile, stages built by hand): half of `backward_s` each, and all
    of `activation_bytes`.

    `loss_s`: seconds per minibatch of the loss function, on the stage holding the graph's
    output (0 elsewhere, and where it was not priced); already in `forward_s` and
    `backward_s` (and in `backward_input_s`: the loss has no weights).
    `recompute`: activation recomputation (docs/memory.md): False keeps every saved activation
    from a forward to its backward; True keeps only the stage's inputs and runs the forward
    again inside the backward; a tuple of node names keeps those nodes' outputs as segment
    boundaries and recomputes each segment from the boundary before it. A recomputing stage's
    `activation_bytes` are what it keeps per microbatch (its inputs, its boundaries), its
    backward (I under a split backward) holds `recompute_bytes` more while it runs (the
    activations of the forward run again, or of its largest segment) and takes `recompute_s`
    longer (that forward, already in `backward_s`).
    `optimizer_s`: seconds of one optimizer step over the stage's parameters, once per update
    (`time_s` carries its share per minibatch, optimizer_s / the schedule's microbatches per
    update, like `allreduce_s`); 0 where it was not priced, and the simulator then charges the
    step the runtime's memory-traffic estimate (docs/simulator.md). `accumulate_s`: seconds a
    backward adds to the stage's held gradients (every microbatch of an update but its first),
    the sum of its nodes'; 0 where not priced (the runtime's estimate, likewise).
    """

    index: int
    nodes: tuple[str, ...]
    replicas: int
    ranks: tuple[int, ...]
    forward_s: float = 0.0
    backward_s: float = 0.0
    backward_input_s: float | None = None
    backward_weight_s: float | None = None
    comm_s: float = 0.0
    allreduce_s: float = 0.0
    memory_bytes: int = 0
    time_s: float = 0.0
    recv_bytes: tuple[tuple[int, int], ...] = ()
    activation_bytes: int = 0
    weight_grad_activation_bytes: int | None = None
    param_bytes: int = 0
    grad_bytes: int = 0
    weight_bytes: int = 0
    param_tensors: int = 0
    no_grad_from: tuple[int, ...] = ()
    loss_s: float = 0.0
    optimizer_s: float = 0.0
    accumulate_s: float = 0.0
    recompute: bool | tuple[str, ...] = False
    recompute_bytes: int = 0
    recompute_s: float = 0.0

    def __post_init__(self) -> None:
        # JSON gives lists of lists: keep the pairs hashable and equal to the original
        if not isinstance(self.recompute, bool):
            if isinstance(self.recompute, str) or not all(
                isinstance(n, str) for n in self.recompute
            ):
                raise PartitionError(
                    f"stage {self.index}: recompute must be False, True or a list of node "
                    f"names (segment boundaries), not {self.recompute!r}"
                )
            object.__setattr__(self, "recompute", tuple(self.recompute))
        object.__setattr__(self, "recv_bytes", tuple((int(s), int(b)) for s, b in self.recv_bytes))
        object.__setattr__(self, "no_grad_from", tuple(int(s) for s in self.no_grad_from))
        if self.backward_input_s is None and self.backward_weight_s is None:
            object.__setattr__(self, "backward_input_s", self.backward_s / 2)
            object.__setattr__(self, "backward_weight_s", self.backward_s / 2)
        elif self.backward_input_s is None or self.backward_weight_s is None:
            raise PartitionError(
                f"stage {self.index}: give both backward_input_s and backward_weight_s, or "
                "neither (half of backward_s each)"
            )
        if self.weight_grad_activation_bytes is None:
            object.__setattr__(self, "weight_grad_activation_bytes", self.activation_bytes)


@dataclass(frozen=True)
class Plan:
    """Stages with replicas and ranks, and what pdcompile's cost model predicts for them.

    `predicted_time`: steady-state seconds per minibatch (1/throughput): the busiest rank's
    stages' `time_s` summed (the bottleneck stage with one stage per rank).
    `step_time`: seconds per `train_step` call under `schedule` with `num_microbatches`, and
    `rank_memory[r]`: peak bytes of rank r, both simulated from the schedule's actions
    (`pdcompile.simulate` gives the same numbers).
    `lower_bound`: total compute over all devices (no plan beats it); `gap` = predicted/bound - 1.
    `data_parallel_time`: the same devices as one data-parallel stage, for speed-ups.
    `ties`: per tensor that several stages use, `(stages, gradient bytes)`: before each update
    their ranks sum its gradients.
    `rank_idle[r]`: the share of the simulated step rank r spends outside compute (its bubble,
    `simulate(plan).bubble_fraction[r]`).
    `uneven_splits`: the stages whose replicas run different numbers of microbatches per step
    (M not a multiple of the replica count; `str(plan)` and `plan()`'s `PlanWarning` say so).
    `unpriced`: what a step does that the costs left out, `"loss"` and/or `"optimizer"` (the
    CostGraph had no `loss_s`, no `optimizer_s`; `str(plan)` says how to price them); () also
    for plans scored before these were priced.
    `clip`, `skip_nonfinite`: whether each update clips the gradients' norm and checks the
    losses first (`compile`'s `clip_grad_norm`, `nonfinite="skip"`): the schedule then has
    their actions and `step_time` prices them (passes/planning/action_costs.py).
    `cluster` may be given in any spelling `Cluster.coerce` takes.
    """

    stages: tuple[Stage, ...]
    cluster: Cluster
    schedule: str = "1f1b"
    num_microbatches: int = 1
    microbatch_size: int | None = None
    solver: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    predicted_time: float = 0.0
    step_time: float = 0.0
    lower_bound: float = 0.0
    gap: float = 0.0
    data_parallel_time: float = 0.0
    fits_memory: bool = True
    solve_time_s: float = 0.0
    ties: tuple[tuple[tuple[int, ...], int], ...] = ()
    rank_memory: tuple[int, ...] = ()
    rank_idle: tuple[float, ...] = ()
    unpriced: tuple[str, ...] = ()
    clip: bool = False
    skip_nonfinite: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, Cluster):  # a spelling, read once
            object.__setattr__(self, "cluster", Cluster.coerce(self.cluster))

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_devices_used(self) -> int:
        """Ranks the stages run on (a rank may run several stages)."""
        return len({r for s in self.stages for r in s.ranks})

    @property
    def edges(self) -> dict[tuple[int, int], bool]:
        """(source stage, destination stage) -> whether gradients flow back along it."""
        return {
            (src, s.index): src not in s.no_grad_from
            for s in self.stages
            for src, _ in s.recv_bytes
        }

    @property
    def stage_of(self) -> dict[str, int]:
        """Node name -> stage index."""
        return {node: s.index for s in self.stages for node in s.nodes}

    @property
    def uneven_splits(self) -> tuple[UnevenSplit, ...]:
        """The stages whose replicas run different numbers of microbatches per step, in stage
        order (none when every replica count divides `num_microbatches`)."""
        splits = (
            UnevenSplit(s.index, s.ranks, replica_split(self.num_microbatches, s.replicas))
            for s in self.stages
        )
        return tuple(u for u in splits if len(set(u.counts)) > 1)

    def uneven_note(self, split: UnevenSplit) -> str:
        """`split.describe` with the plan's simulated idle shares (`rank_idle`): the text of
        `str(plan)`'s notes and of the `PlanWarning` `plan()` gives."""
        return split.describe(self.rank_idle)

    @property
    def speedup_over_data_parallel(self) -> float:
        return self.data_parallel_time / self.predicted_time if self.predicted_time else 0.0

    def with_(self, **changes: Any) -> Plan:
        return replace(self, **changes)

    @property
    def rules(self) -> PipelineSchedule:
        """The schedule the plan runs: its kind (`schedule`) as the plan fits it
        (`PipelineSchedule.for_plan`: a `synth` plan's orders are its own).

        Raises:
            ScheduleError: no schedule has that name.
        """
        return get_schedule(self.schedule).for_plan(self.options)

    # -- text ------------------------------------------------------------------------------

    def __str__(self) -> str:
        header = (
            f"Plan by {self.solver or '?'} for {self.cluster} "
            f"({self.cluster.num_devices} devices), "
            f"schedule {self.schedule}, {self.num_microbatches} microbatches"
        )
        rows = [("stage", "nodes", "replicas", "ranks", "fwd", "bwd", "comm", "allreduce",
                 "time", "memory", "of bottleneck")]  # fmt: skip
        bottleneck = max((s.time_s for s in self.stages), default=0.0)
        for s in self.stages:
            first, last = (s.nodes[0], s.nodes[-1]) if s.nodes else ("-", "-")
            ranks = f"{s.ranks[0]}-{s.ranks[-1]}" if len(s.ranks) > 1 else str(s.ranks[0])
            rows.append((
                str(s.index), f"{len(s.nodes)} ({first}..{last})", str(s.replicas), ranks,
                human_seconds(s.forward_s), human_seconds(s.backward_s), human_seconds(s.comm_s),
                human_seconds(s.allreduce_s), human_seconds(s.time_s), human_bytes(s.memory_bytes),
                f"{s.time_s / bottleneck:.0%}" if bottleneck else "-",
            ))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        from pdcompile.passes.planning.plan_words import (
            describe,  # it reads the options price() records
        )

        lines = [describe(self), header, *self.cluster.describe_measurement()] + [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        speedup = f"{self.speedup_over_data_parallel:.2f}x" if self.data_parallel_time else "-"
        step = human_seconds(self.step_time) if self.step_time else "- (not simulated)"
        lines.append(
            f"predicted step {step} ({self.num_microbatches} microbatches); per microbatch: "
            f"bottleneck {human_seconds(self.predicted_time)}, lower bound "
            f"{human_seconds(self.lower_bound)} (gap {self.gap:.1%}), data parallelism "
            f"{human_seconds(self.data_parallel_time)} (speed-up over data parallelism {speedup})"
            + ("" if self.fits_memory else "; DOES NOT FIT device memory")
        )
        lines += self._step_cost_lines()
        scaling = self.options.get("row_scaling")  # evaluation.price: how times follow the rows
        if scaling and self.microbatch_size:
            lines.append(f"times at {self.microbatch_size} rows per microbatch: {scaling}")
        stages_of_rank: dict[int, list[str]] = {}
        for s in self.stages:
            for rank in s.ranks:
                stages_of_rank.setdefault(rank, []).append(str(s.index))
        if any(len(stages) > 1 for stages in stages_of_rank.values()):  # chunks: once per rank
            for rank, stages in sorted(stages_of_rank.items()):
                line = f"rank {rank} runs stages {', '.join(stages)}"
                if rank < min(len(self.rank_memory), len(self.rank_idle)):  # simulated
                    line += (f": peak memory {human_bytes(self.rank_memory[rank])}, idle "
                             f"{self.rank_idle[rank]:.1%} of the step")  # fmt: skip
                lines.append(line)
        lines += [f"note: {self.uneven_note(u)}" for u in self.uneven_splits]
        return "\n".join(lines)

    def _step_cost_lines(self) -> list[str]:
        """The loss and the optimizer step, where priced (in fwd/bwd and time above)."""
        lines = []
        for s in self.stages:
            if s.loss_s:
                lines.append(
                    f"loss {human_seconds(s.loss_s)}/minibatch on stage {s.index} (in its fwd "
                    "and bwd)"
                )
        if any(s.optimizer_s for s in self.stages):
            steps = ", ".join(
                f"stage {s.index} {human_seconds(s.optimizer_s)}" for s in self.stages
            )
            lines.append(f"optimizer step per update: {steps}")
        recomputing = [s for s in self.stages if s.recompute]
        if recomputing:
            how = ", ".join(
                f"stage {s.index} "
                + (
                    "whole"
                    if s.recompute is True
                    else f"in segments after {', '.join(s.recompute)}"
                )
                for s in recomputing
            )
            slowdown = self.options.get("recomputation", {}).get("slowdown")
            more = f"; predicted {slowdown:+.1%} on the step" if slowdown is not None else ""
            lines.append(f"activation recomputation: {how}{more}")
        how = {
            "loss": "the loss function (analyze(..., loss_fn=, targets=); compile(..., "
            "example_targets=))",
            "optimizer": "the optimizer step (analyze(..., optimizer=))",
        }
        if self.unpriced:
            missing = ", ".join(how.get(what, what) for what in self.unpriced)
            lines.append(f"not priced: {missing}")
        return lines

    # -- JSON ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON values. A figure `from_dict` would refuse (not finite, negative,
        an integer of `INT64` or more: from costs out of range) raises `PartitionError`."""
        data = asdict(self)
        data["cluster"] = self.cluster.to_dict()
        data["options"] = dict(self.options)
        data["stages"] = [
            {**asdict(s), "nodes": list(s.nodes), "ranks": list(s.ranks)} for s in self.stages
        ]
        try:
            for i, stage in enumerate(data["stages"]):
                _fields(Stage, stage, f"stage #{i}")
            _fields(Plan, data)
        except PartitionError as e:
            raise PartitionError(
                f"the plan cannot be written: {e}; check the seconds and bytes of the costs it "
                "was priced with (pdcompile graph COSTS)"
            ) from None
        return {"format": FORMAT, "version": VERSION, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<plan>") -> Plan:
        """A plan from `to_dict()`'s output (parsed JSON), every field checked.

        Raises:
            PartitionError: not a plan of this format, a field missing, unknown, of the
                wrong type or out of range (naming the stage and field), or stages that do not
                fit together or on the plan's cluster (`runtime.validate.check_layout`).
        """
        from pdcompile.passes.planning.validate import check_layout

        if not isinstance(data, Mapping):
            raise PartitionError(
                f"{source}: not a pdcompile plan (a JSON {type(data).__name__}, not an object); "
                "write plans with Plan.save"
            )
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise PartitionError(
                f"{source}: not a pdcompile plan (format {data.get('format')!r}, version "
                f"{data.get('version')!r}); write plans with Plan.save"
            )
        try:
            fields = _fields(cls, {k: v for k, v in data.items() if k not in ("format", "version")})
            stages = tuple(
                Stage(**_fields(Stage, s, f"stage #{i}")) for i, s in enumerate(fields["stages"])
            )
            check_schedule(fields.get("schedule", "1f1b"))
            fields.update(stages=stages, cluster=Cluster.from_dict(data["cluster"]))
            solver = fields.get("solver", "")
            fields["solver"] = RENAMED_SOLVERS.get(solver, solver)
            plan = cls(**fields)
            check_layout(plan, plan.cluster.num_devices)
            return plan
        except PartitionError as e:
            raise PartitionError(f"{source}: {e}; write plans with Plan.save") from None
        except (KeyError, TypeError, ValueError) as e:
            raise PartitionError(
                f"{source}: malformed plan ({type(e).__name__}: {e}); write plans with Plan.save"
            ) from None

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PartitionError(
                f"{source}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); the plan file is "
                "truncated or corrupt"
            ) from None
        except RecursionError:
            raise PartitionError(
                f"{source}: JSON nested too deeply for a plan; the plan file is corrupt"
            ) from None
        return cls.from_dict(data, source)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            text = read_regular_text(path)
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or e
            raise PartitionError(f"cannot read plan {path}: {reason}") from None
        return cls.from_json(text, str(path))


def _fields(cls: type, values: Any, where: str = "") -> dict[str, Any]:
    """`values` (a JSON object) as keyword arguments of the dataclass `cls`: each of its field's
    type (lists become tuples), no unknown field. Types it does not know (`Cluster`) pass."""
    where = f"{where}: " if where else ""
    if not isinstance(values, Mapping):
        raise PartitionError(f"{where}a {type(values).__name__}, not an object")
    hints = typing.get_type_hints(cls)
    if unknown := sorted(str(k) for k in values if k not in hints):
        raise PartitionError(f"{where}unknown fields {unknown[:5]}")
    required = [
        f.name for f in dataclass_fields(cls)
        if f.default is MISSING and f.default_factory is MISSING
    ]  # fmt: skip
    if missing := [name for name in required if name not in values]:
        raise PartitionError(f"{where}missing fields {missing}")
    for name, value in values.items():
        if not _fits(value, hints[name], name in SIGNED):
            kind = _type_name(hints[name])
            rule = "finite" if name in SIGNED else "finite, >= 0"
            rule = f" ({rule}, below 2**63)" if "int" in kind or "float" in kind else ""
            raise PartitionError(f"{where}field {name!r} is {_brief(value)}, not {kind}{rule}")
    return {name: _tupled(value) for name, value in values.items()}


def _fits(value: Any, hint: Any, signed: bool = False) -> bool:
    """Whether a JSON value has the type `hint`: numbers finite, >= 0 unless `signed`, and
    integers int64 (floats of integral value welcome where a float is)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        kinds = int if hint is int else (int, float)
        return (  # abs(value) < INT64: finite too (not NaN, not inf)
            isinstance(value, kinds) and not isinstance(value, bool) and abs(value) < INT64
            and (signed or value >= 0)
        )  # fmt: skip
    if hint is str:
        return isinstance(value, str)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg, signed) for arg in args)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):  # JSON's lists, `to_dict`'s tuples
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0], signed) for v in value)
        return len(value) == len(args) and all(map(_fits, value, args, [signed] * len(args)))
    if origin in (dict, Mapping):
        return isinstance(value, dict)
    return True


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) if typing.get_origin(hint) is None else str(hint)


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_schedule(schedule: str) -> str:
    """`schedule` if it is a registered schedule's name (`pdcompile.schedules()`).

    Raises:
        PartitionError: it is not (the message lists the registered ones).
    """
    try:
        return get_schedule(schedule).name
    except ScheduleError as exc:
        raise PartitionError(str(exc)) from None


def consecutive_ranks(replicas: Sequence[int]) -> list[tuple[int, ...]]:
    """Ranks of each stage: the replicas of stage s occupy the next `replicas[s]` ranks."""
    ranks, start = [], 0
    for r in replicas:
        ranks.append(tuple(range(start, start + r)))
        start += r
    return ranks
