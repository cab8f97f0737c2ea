"""`compile`'s steps up to the plan every rank runs: capture, agree, plan on rank 0, share."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from pdcompile.compiling.ranks import Job, check_fingerprints, collective, fingerprint, share_plan
from pdcompile.compiling.settings import Settings
from pdcompile.compiling.weights import on_meta, to_meta
from pdcompile.core.cluster import DEFAULT_BANDWIDTH, Cluster
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PlanConfigError
from pdcompile.passes.planning.plans import Plan
from pdcompile.scheduling import PipelineSchedule


class Captured(NamedTuple):
    """The capture: the graph, the example call it was captured with (on the meta device for a
    model without values), the plan given (`plan=`, read) and whether the graph is on meta."""

    gm: torch.fx.GraphModule
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any] | None
    given: Plan | None
    on_meta: bool


class Planned(NamedTuple):
    """Rank 0's plan and the costs it planned with (None elsewhere, or given), or its
    failure; `left_s`: what is left of the start-up timeout to wait for it."""

    plan: Plan | None
    costs: CostGraph | None
    failure: Exception | None
    left_s: float


def capture(model: nn.Module, settings: Settings, job: Job) -> Captured:
    """Capture `model` (`trace`) and read a given plan; a rank that fails tells the others
    (in place of its fingerprint), and every rank stops."""
    from pdcompile.capture.tracing import trace

    call = settings.capture
    inputs, kwargs = call.example_inputs, call.example_kwargs
    if on_meta(model):  # a model without values: capture and cost it on the meta device too
        inputs, kwargs = to_meta(inputs), to_meta(kwargs)
    try:
        gm = trace(model, inputs, example_kwargs=kwargs, leaf_modules=call.leaf_modules,
                   batch_dims=call.batch_dims)  # fmt: skip
        given = settings.plan.plan
        if isinstance(given, str):
            given = Plan.load(given)
    except Exception as exc:
        if job.distributed:
            check_fingerprints(exc, job, settings.train.startup_timeout)  # tells the others
        raise
    return Captured(gm, inputs, kwargs, given, on_meta(gm))


def agree(captured: Captured, settings: Settings, job: Job) -> Cluster | None:
    """Check that every rank captured the same graph with the same options and plan; then, in
    a job of two or more ranks without a cluster or a plan, measure its cluster. Returns the
    cluster to plan on (None: the job's one device per rank)."""
    config, train, given = settings.plan, settings.train, captured.given
    if job.distributed:
        options = _agreed_options(settings, given)
        check_fingerprints(fingerprint(captured.gm, options), job, train.startup_timeout,
                           (captured.gm, options))  # fmt: skip
    if config.cluster is None and job.distributed and job.world_size > 1 and given is None:
        from pdcompile.runtime.cluster_measure import measure_cluster

        return collective(job.rank, "measuring the cluster", lambda: measure_cluster(
            job.rank, job.world_size, job.device, timeout_s=train.startup_timeout),
            train.startup_timeout)  # fmt: skip
    return config.cluster


def _agreed_options(settings: Settings, given: Plan | None) -> dict[str, Any]:
    """The options every rank must agree on, with a given plan's stages and schedule (not,
    e.g., how long solving it took)."""
    config, train = settings.plan, settings.train
    policy = train.replan
    return dict(
        schedule=config.schedule if config.auto else config.rules.name,
        num_microbatches=config.num_microbatches, solver=config.solver, profile=config.profile,
        cluster=str(config.cluster), clip=train.clip_grad_norm, vertical=train.vertical_sync,
        nonfinite=train.nonfinite,
        plan=[(s.nodes, s.ranks) for s in given.stages] + [given.schedule] if given else None,
        batch=config.global_batch_size, batch_dims=settings.capture.batch_dims,
        replan=policy and (policy.after_steps, policy.threshold),
        checkpoint_every=train.checkpoint_every, memory=str(config.memory),
        recompute=config.recompute,
    )  # fmt: skip


def plan_on_rank_0(
    model: nn.Module, captured: Captured, settings: Settings, cluster: Cluster | None, job: Job
) -> Planned:
    """Rank 0 costs the graph (`analyze`, unless `costs=`) and plans it, while the other ranks
    on its machine train as in the run (`runtime/profile_load.py`) and then wait for the plan
    within the same start-up timeout (not once more). A given plan skips both."""
    from pdcompile.runtime.profile_load import ProfileLoad, example_step

    train, given = settings.train, captured.given
    loaded = job.distributed and given is None and settings.plan.profile and not captured.on_meta
    load = ProfileLoad(job.rank, job.world_size, loaded, train.startup_timeout)
    planning = given is None and job.rank == 0
    planned = Planned(given, None, None, train.startup_timeout)
    if planning:
        try:
            with load.profiling() as loaded_by:
                costs = _costs(captured, settings, loaded_by)
            cluster = cluster or Cluster([(job.world_size, DEFAULT_BANDWIDTH)])
            planned = planned._replace(plan=_plan(costs, cluster, settings, job), costs=costs)
        except Exception as exc:
            if not job.distributed:
                raise
            planned = planned._replace(failure=exc)
    waiting = time.monotonic()
    if not planning:
        step = example_step(model, captured.inputs, captured.kwargs, train.loss_fn,
                            settings.capture.example_targets)  # fmt: skip
        load.serve(step, train.startup_timeout)
    return planned._replace(left_s=max(1.0, train.startup_timeout - (time.monotonic() - waiting)))


def _costs(captured: Captured, settings: Settings, loaded_by: int) -> CostGraph:
    """The costs to plan with: `costs=` (read), else the graph's, profiled or analytic."""
    from pdcompile.compiling import analysis

    given = settings.plan.costs
    if given is not None:
        return CostGraph.load(given) if isinstance(given, str) else given
    config, train = settings.plan, settings.train
    return analysis.analyze(captured.gm, captured.inputs, example_kwargs=captured.kwargs,
                            profile=config.profile, optimizer=train.optimizer,
                            loss_fn=train.loss_fn, loaded_by=loaded_by,
                            targets=settings.capture.example_targets, autocast=train.autocast,
                            max_rows=config.global_batch_size)  # fmt: skip


def _plan(costs: CostGraph, cluster: Cluster, settings: Settings, job: Job) -> Plan:
    """`plan()` with the settings, on `cluster`, `memory="auto"` read on this rank's device."""
    from pdcompile.passes.planning.planner import plan
    from pdcompile.runtime.memory_probe import device_memory

    config = settings.plan
    memory = device_memory(config.memory, job.device, cluster.num_devices)
    return plan(costs, config=config.replace(cluster=cluster, memory=memory))


def share(
    planned: Planned, captured: Captured, settings: Settings, job: Job
) -> tuple[Plan, PipelineSchedule]:
    """Rank 0's plan on every rank, and the schedule that runs it; then every rank prepares it
    (in an agreed phase): re-scored at a count given that differs, simulated with the clipping
    and non-finite check every update runs, checked against the job."""
    from pdcompile.passes.planning.evaluation import rescore, simulated
    from pdcompile.passes.planning.validate import check_layout

    config, train = settings.plan, settings.train
    shared = None
    if job.distributed:
        shared = share_plan(planned.plan, planned.failure, job.rank, planned.left_s)
    with job.phase(train.startup_timeout)("preparing the plan"):
        plan = planned.plan if shared is None else Plan.from_json(shared)  # as it travelled
        # the plan's: auto's choice; a schedule fitted to its plan (synth) as the plan fits it
        rules = plan.rules if config.auto else config.rules.for_plan(plan.options)
        if config.auto:  # the schedule the plan chose: checked now
            train.check_schedule(rules)
        if config.num_microbatches not in (None, plan.num_microbatches):
            plan = rescore(plan, num_microbatches=config.num_microbatches)  # what runs is scored
        updates = {"clip": train.clip, "skip_nonfinite": train.skip_nonfinite}
        if any(getattr(plan, k) != v for k, v in updates.items()):
            plan = simulated(plan.with_(**updates))  # the clip and check every update runs
        if job.distributed:  # every rank, before its stages send anything
            check_layout(plan, job.world_size, world=True)
        if captured.on_meta and train.replan is not None:
            raise PlanConfigError("replan= with a model on the meta device is not supported yet")
    return plan, rules
