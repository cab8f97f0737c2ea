"""The schedule simulator: a plan's action lists executed on modelled time. Torch-free.

`simulate` builds the per-rank actions the runtime walks (the plan's schedule through
`pdcompile.scheduling.build_schedule`, with the plan's tie groups) and runs them on an event heap:
compute takes the plan's seconds, a message travels from its `send` at the bandwidth of the link it
uses (shared fairly with the transfers on that link at the same time) plus the level's latency, a
`recv` waits for its message, collectives wait for their whole group, and the runtime's own work
(packing messages, accumulating gradients, weight copies, optimizer steps: `action_costs`) takes
what the cluster's `RuntimeCosts` say. Every `train_step` ends with the last stage's ranks sending
the loss to every other rank, which waits for it before its next call; under a streaming schedule
(`pipedream`, `2bw`) it walks the endless stream in calls of `num_microbatches` microbatches, as
`DistributedPipeline.train_step` does. docs/simulator.md has the model.

Example:
    >>> sim = pdcompile.simulate(plan, schedule="gpipe", num_microbatches=8)
    >>> sim.time_per_step, sim.bubble_fraction, sim.peak_memory
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdcompile.core.cluster import Cluster
from pdcompile.core.errors import PartitionError
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.sim_engine import Engine
from pdcompile.passes.planning.timeline import Event, to_chrome_trace
from pdcompile.passes.planning.validate import check_layout, check_num_microbatches
from pdcompile.scheduling import PipelineSchedule, Schedule, get_schedule
from pdcompile.scheduling.action_kinds import is_compute
from pdcompile.scheduling.builder import Layout, build

__all__ = ["MAX_ACTIONS", "Simulation", "simulate"]

# The most actions a simulation runs (every rank's computes, messages, collectives and updates,
# all steps together): about 30 s and 1 GiB on one CPU core. `simulated_actions` estimates the
# count before anything is built, and a plan or simulation above it is refused.
MAX_ACTIONS = 2_000_000


@dataclass(frozen=True)
class Simulation:
    """What a simulated run did and cost.

    `timeline`: every action of every rank (seconds from 0); `time_per_step`: seconds per
    `train_step` (synchronous schedules: one step's span; streaming ones: the last,
    steady-state call); `bubble_fraction[rank]`: the share of that span the rank spends
    outside compute (`F`, `B`, `I`, `W`); `memory[rank]`: (time, bytes in use) after each change;
    `peak_memory[rank]`: its maximum; `stage_memory[stage]`: the peak of that stage's own
    share of its rank (the largest over its replicas); `message_memory[rank]`: of the memory,
    the message buffers the runtime keeps from the first message on
    (`pdcompile/core/message_buffers.py`); `held_memory[rank]`: the peak without them and
    without what a recomputing backward holds inside it only (what a CPU run's memory probe's
    parts see: docs/memory.md).
    """

    plan: Plan
    schedule: Schedule
    timeline: list[Event]
    time_per_step: float
    bubble_fraction: list[float]
    peak_memory: list[int]
    memory: list[list[tuple[float, int]]]
    stage_memory: list[int]
    held_memory: list[int] = field(default_factory=list)
    message_memory: list[int] = field(default_factory=list)

    @property
    def schedule_memory(self) -> list[int]:
        """Per rank, the peak less the message buffers: what the schedule's actions hold."""
        buffers = self.message_memory or [0] * len(self.peak_memory)
        return [peak - held for peak, held in zip(self.peak_memory, buffers, strict=True)]

    def to_chrome_trace(self, path: str | Path | None = None) -> dict[str, Any]:
        """The timeline as Chrome trace-event JSON (opens in Perfetto), written to `path`."""
        return to_chrome_trace(self.timeline, path)


def simulate(
    plan: Plan,
    *,
    schedule: str | PipelineSchedule | None = None,
    num_microbatches: int | None = None,
    cluster: Cluster | str | int | None = None,
) -> Simulation:
    """Simulate one `train_step` of `plan` (for `pipedream` and `2bw`, enough calls to reach
    their steady state) under `schedule` with `num_microbatches` on `cluster` (defaults: the
    plan's; `cluster`: any spelling `Cluster.coerce` takes).

    A stage's `forward_s`/`backward_s` are taken per microbatch (plan at the microbatch size).
    Tie groups (`plan.ties`) add their all-reduces before each update of their stages.

    Raises:
        PartitionError: the plan has no per-stage byte counts (not scored by this version's
            `pdcompile.evaluate`), `cluster` is no cluster or has too few devices for its
            ranks, or a tie group names stages the plan does not have.
        ScheduleError: the schedule cannot be built (e.g. `2bw` with fewer microbatches than
            stages) or deadlocks.
    """
    if not plan.rank_memory and not any(
        s.recv_bytes or s.weight_bytes or s.activation_bytes for s in plan.stages
    ):
        raise PartitionError(
            "the plan has no per-stage byte counts (recv_bytes, activation_bytes, weight_bytes: "
            "written by an older pdcompile or never scored); re-score it with "
            "pdcompile.evaluate(plan, cost_graph) or re-plan with `pdcompile plan`"
        )
    m = plan.num_microbatches if num_microbatches is None else num_microbatches
    return run(
        plan, plan.rules if schedule is None else get_schedule(schedule), check_num_microbatches(m),
        plan.cluster if cluster is None else Cluster.coerce(cluster),
    )  # fmt: skip


def run(plan: Plan, rules: PipelineSchedule, m: int, cluster: Cluster) -> Simulation:
    """`simulate` of a plan `evaluate` is scoring (its byte counts may all be zero).

    Raises:
        PartitionError: the plan does not fit `cluster` (`check_layout`), or its simulation
            would run more than `MAX_ACTIONS` actions (said before it starts).
    """
    _check(plan, cluster)
    plan = _on(plan, cluster).with_(schedule=rules.name, num_microbatches=m)
    ranks = [s.ranks for s in plan.stages]
    ties = [stages for stages, _ in plan.ties]
    skip = plan.skip_nonfinite and not rules.streaming
    layout = Layout(ranks, plan.edges, m, ties, plan.clip, skip)
    if not rules.streaming:
        _check_size(plan, rules, 1)
        engine = Engine(plan, build(rules, layout), rules)
        engine.run_call(math.inf)
        return _result(engine, dict.fromkeys(engine.release, 0.0), engine.release)
    replicas = [s.replicas for s in plan.stages]
    calls = rules.steady_calls(replicas, m)
    # a replica of stage s runs its items in the endless stream's order while r_s w_s more
    # microbatches follow the last one the calls give (then the finite schedule's drain starts)
    ahead = max(r * w for r, w in zip(replicas, rules.warmups(replicas, m), strict=True))
    steps = calls + -(-ahead // m) + 1
    _check_size(plan, rules, steps)
    engine = Engine(plan, build(rules, layout, num_steps=steps), rules)
    start = engine.release
    for call in range(1, calls + 1):
        start = engine.release
        engine.run_call(call * m)
    return _result(engine, start, engine.release)


def simulated_actions(plan: Plan, rules: PipelineSchedule, steps: int) -> int:
    """About how many actions simulating `steps` steps of `plan` under `rules` runs: per
    microbatch, each stage's computes (and weight stashes, streaming) and each channel's sends
    and receives; per rank and step, its updates and collectives, and the loss it receives
    from every replica of the last stage."""
    stages = plan.num_stages * (rules.items_per_microbatch + 2 * rules.streaming)
    messages = sum(4 if grad else 2 for grad in plan.edges.values())
    updates = 4 * (len(plan.ties) + 2 + plan.clip + plan.skip_nonfinite)
    per_rank = updates + (plan.stages[-1].replicas if plan.stages else 0)
    return steps * (plan.num_microbatches * (stages + messages) + plan.num_devices_used * per_rank)


def _check_size(plan: Plan, rules: PipelineSchedule, steps: int) -> None:
    actions = simulated_actions(plan, rules, steps)
    if actions > MAX_ACTIONS:
        ranks, last = plan.num_devices_used, plan.stages[-1].replicas
        losses = steps * ranks * last
        why = (
            f" ({losses:,} of them the loss each rank receives from the last stage's {last} "
            "replicas)" if 2 * losses > actions else ""
        )  # fmt: skip
        raise PartitionError(
            f"simulating {plan.num_microbatches} microbatches of {plan.num_stages} stages on "
            f"{ranks} ranks under {rules.name} runs about {actions:,} actions{why}, above the "
            f"budget of {MAX_ACTIONS:,} (pdcompile.passes.planning.simulator.MAX_ACTIONS); use "
            "fewer "
            "microbatches (num_microbatches), or plan for fewer devices"
        )


def _check(plan: Plan, cluster: Cluster) -> None:
    used = max((r for s in plan.stages for r in s.ranks), default=0)
    if used >= cluster.num_devices:
        raise PartitionError(
            f"the plan uses ranks up to {used} but cluster {cluster} has {cluster.num_devices} "
            "devices; simulate on a cluster with at least as many"
        )
    check_layout(plan, cluster.num_devices)


def _on(plan: Plan, cluster: Cluster) -> Plan:
    """`plan` on `cluster`: stage times rescaled where its devices' speeds differ."""
    stages = []
    for s in plan.stages:
        factor = plan.cluster.device_speed(s.ranks) / cluster.device_speed(s.ranks)
        stages.append(replace(
            s, forward_s=s.forward_s * factor, backward_s=s.backward_s * factor,
            backward_input_s=s.backward_input_s * factor,
            backward_weight_s=s.backward_weight_s * factor, loss_s=s.loss_s * factor,
            optimizer_s=s.optimizer_s * factor,
        ))  # fmt: skip
    return plan.with_(stages=tuple(stages), cluster=cluster)


def _result(engine: Engine, start: dict[int, float], end: dict[int, float]) -> Simulation:
    """The simulation: the time per step is the longest call [start, end] of a rank (the
    ranks' calls overlap), and each rank's bubble the share of that time its own call
    spends outside compute."""
    span = max(end[r] - start[r] for r in engine.actions)
    busy = dict.fromkeys(engine.actions, 0.0)
    for e in engine.events:
        if is_compute(e.kind) and e.start >= start[e.rank]:
            busy[e.rank] += e.end - e.start
    count = max(engine.actions) + 1
    bubble = [1.0 - busy[r] / span if span > 0 and r in busy else 0.0 for r in range(count)]
    memory = [engine.memory.get(r, [(0.0, 0)]) for r in range(count)]
    stage_memory = [0] * engine.plan.num_stages
    for (_, stage), peak in engine.stage_peak.items():
        stage_memory[stage] = max(stage_memory[stage], peak)
    return Simulation(
        plan=engine.plan, schedule=engine.schedule, timeline=engine.events, time_per_step=span,
        bubble_fraction=bubble, peak_memory=[max(b for _, b in m) for m in memory],
        memory=memory, stage_memory=stage_memory,
        held_memory=[engine.held_peak.get(r, 0) for r in range(count)],
        message_memory=[engine.messages.get(r, 0) for r in range(count)],
    )  # fmt: skip
