"""`pdcompile.compile`: any nn.Module to a pipelined one, in one call on every rank.

The lowering, top to bottom:
1. join the process group (torchrun's variables, or one already initialised), if any;
2. capture the model (`trace`), the same on every rank;
3. check a fingerprint of the graph, the call, the options and a given plan against rank 0's (a
   rank started with another model, input, option or plan fails here, naming it; a rank that
   could not capture tells the others, which stop too);
4. plan (rank 0: costs from `analyze`, profiled while the other ranks on its machine train as in
   the run, `runtime/profile_load.py`; then `plan`; or the given `plan=`), and broadcast it (or
   rank 0's error, so no rank waits for a plan that will not come);
5. generate the stage modules (`codegen`);
6. build the executor: this process's rank over torch.distributed, or, without a process group,
   every rank of the plan in this process (the local executor).
From step 4's broadcast on, each phase (reading the plan, codegen, the executor, resuming, the
memory probe) ends with the ranks agreeing on how it went (`_agreement`): a rank that fails
raises its own error and every other rank one of its class naming that rank and its message.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from pdcompile import errors
from pdcompile.closed_loop.decision import Replan
from pdcompile.cluster import AUTO as MEASURED
from pdcompile.cluster import DEFAULT_BANDWIDTH, Cluster
from pdcompile.cost_graph import CostGraph
from pdcompile.errors import (
    CheckpointError,
    CostError,
    PartitionError,
    PdcompileError,
    PipelineTimeoutError,
    ScheduleError,
)
from pdcompile.plans import Plan
from pdcompile.schedules import PipelineSchedule

AFTER_TIMEOUT_S = 2.0  # how long a rank that timed out waits to agree on a phase


def compile(  # noqa: A001 - the public name API.md gives it
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    example_kwargs: dict[str, Any] | None = None,
    example_targets: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    cluster: Cluster | str | int | None = None,
    schedule: str | PipelineSchedule = "1f1b",
    num_microbatches: int | None = None,
    solver: str = "dynprog",
    plan: Plan | str | None = None,
    profile: bool = True,
    leaf_modules: Sequence[Any] = (),
    batch_dims: dict[str, int | None] | None = None,
    autocast: torch.dtype | None = None,
    clip_grad_norm: float | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    timeout: float = 300.0,
    startup_timeout: float = 900.0,
    weights: Callable[[], dict[str, torch.Tensor]] | str | None = None,
    vertical_sync: bool = False,
    nonfinite: str = "raise",
    allow_async: bool = False,
    global_batch_size: int | None = None,
    costs: CostGraph | str | None = None,
    replan: bool | Replan = False,
    measure_memory: bool = False,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    memory: float | str | None = None,
    recompute: bool | None = None,
) -> Any:
    """Turn `model` into a pipelined module: call it the same way on every rank.

    Args:
        model: the model, in the mode to train (`model.train()`).
        example_inputs: one example call's positional inputs (a microbatch or a batch).
        example_kwargs: its keyword inputs.
        example_targets: the targets of the example's rows, as `train_step` gets them: with
            them the profile prices `loss_fn` on the last stage (`analyze(loss_fn=,
            targets=)`); None: the loss is left out of the plan, which `explain()` says.
        loss_fn: `loss_fn(output, target) -> scalar`, run on the last stage.
        optimizer: a factory `params -> torch.optim.Optimizer`, applied to each stage; the
            profile times its step per node and sizes its state.
        cluster: the devices (a `Cluster`, its text or a number of devices:
            `Cluster.coerce`); None or "auto": in a job of two or more ranks, the job measures
            its hosts, links, rank speeds and memory before planning
            (`runtime/cluster_measure.py`, cached for a day; `explain()` says how), else one
            device; a given `plan` keeps its own cluster.
        schedule: a name from `pdcompile.schedules()`: "1f1b" (default: synchronous, equal to
            single-process gradient accumulation), "gpipe", "pipedream" (asynchronous, weight
            stashing), "2bw", or one registered with `pdcompile.register_schedule`; "auto":
            rank 0 plans every synchronous schedule and runs the fastest that fits
            (`plan(..., schedule="auto")`; a given `plan` runs its own schedule), and
            `explain()` shows the comparison.
        num_microbatches: microbatches per `train_step` (default: what `plan()` chose, or the
            given plan's count).
        solver: the partitioning solver (`pdcompile.solvers()`).
        plan: a Plan (or a saved plan's path): skips profiling and solving.
        profile: measure node times (False: analytic costs, e.g. for meta-device models).
        leaf_modules: modules the capture keeps whole (classes or qualified names).
        batch_dims: inputs whose batch is not along dim 0, by name: the dimension holding it,
            or None for an input every microbatch gets whole (`trace(batch_dims=)`).
        autocast: a dtype for `torch.autocast` around every forward (weights stay fp32).
        clip_grad_norm: the largest gradient norm (global; per stage under `pipedream`, where
            stages sharing tied weights clip together).
        lr_scheduler: a factory `optimizer -> LRScheduler`, stepped after every update.
        timeout: seconds any wait of a training step may last.
        startup_timeout: seconds the start-up (capture, planning, broadcast) may last.
        weights: for a model on the meta device: a function returning its state dict, or a
            checkpoint directory; each rank materialises only its own stage's tensors.
        vertical_sync: under `pipedream`, minibatch k runs at every stage on weights that
            include only the minibatches stage 0's weights for k include (docs/runtime.md).
        nonfinite: what a NaN or infinite loss does: "raise" a `LossError` naming the step,
            stage and microbatch, or "skip" the step on every rank (no update, no scheduler
            step; `1f1b` and `gpipe` only; `skipped_steps` counts them).
        allow_async: with schedule="auto", `pipedream` and `2bw` are candidates too.
        global_batch_size: the rows each `train_step` will run: the planner chooses the
            microbatch count among those dividing it (`plan(..., global_batch_size=)`; with
            "auto", together with the schedule). None: the example is one microbatch.
        costs: a CostGraph (or its JSON file) of this model to plan with instead of profiling
            it (e.g. `pdcompile profile --out costs.json` run once).
        replan: the closed loop: after `Replan.after_steps` steps the stages' measured times
            rescale the costs, rank 0 plans again, and when the new plan is predicted at least
            `Replan.threshold` faster, every rank moves to it (a checkpoint of the running plan,
            then the new stages load it by name; `explain()` shows both plans and the measured
            step before and after). True: `Replan()`'s defaults. Needs the costs the plan was
            made from (profiled here, or `costs=`).
        measure_memory: measure what each rank holds (`PipelinedModule.measure_memory`:
            parameters, gradients, optimizer state, weight versions, saved activations), which
            `explain()` compares with the plan's `rank_memory`.
        checkpoint_dir: a folder every rank sees: on start every rank loads the newest valid
            checkpoint in it (`PipelinedModule.resume`; `steps` goes on from its step count),
            and every `checkpoint_every` steps the job saves `step-<steps>` there, keeping
            the newest 3 (docs/checkpoints.md). One rank per stage (torchrun).
        checkpoint_every: train steps between automatic checkpoints (with `checkpoint_dir`).
        memory, recompute: as `plan(..., memory=, recompute=)`; memory="auto" is rank 0's
            device's (CUDA: total memory, CPU: available RAM per rank; less 10%: docs/memory.md).

    Returns:
        A `PipelinedModule`.

    Raises:
        PdcompileError: (a subclass saying which phase) `cluster` is no cluster, the model
            cannot be captured, no plan fits, the ranks disagree on the model, or the plan
            needs more ranks than the job.
    """
    from pdcompile.analysis import analyze
    from pdcompile.capture.tracing import trace
    from pdcompile.closed_loop.move import Replanner, resume_saved_plan
    from pdcompile.codegen.stage_codegen import codegen
    from pdcompile.evaluation import rescore, simulated
    from pdcompile.pipelined_module import PipelinedModule
    from pdcompile.planning import plan as make_plan
    from pdcompile.runtime.auto_resume import auto_checkpoint
    from pdcompile.runtime.distributed import init_process_group
    from pdcompile.runtime.executor import DistributedPipeline
    from pdcompile.runtime.local import LocalPipeline
    from pdcompile.runtime.memory_probe import device_memory
    from pdcompile.runtime.pipeline import program_schedule
    from pdcompile.runtime.profile_load import ProfileLoad, example_step
    from pdcompile.runtime.validate import check_layout
    from pdcompile.schedules import check_nonfinite, get_schedule
    from pdcompile.search.schedule_choice import AUTO

    check_arguments(optimizer, num_microbatches, clip_grad_norm, timeout, startup_timeout)
    check_plan_arguments(solver=solver, memory=memory, recompute=recompute,
                         global_batch_size=global_batch_size, allow_async=allow_async)  # fmt: skip
    policy = Replan() if replan is True else replan or None
    if policy is not None and not isinstance(policy, Replan):
        raise PartitionError(f"replan must be True, False or a pdcompile.Replan, got {replan!r}")
    if policy is not None and plan is not None and costs is None:
        raise PartitionError(
            "replan needs the costs the plan was made from to rescale them: pass costs= (the "
            "CostGraph or its JSON file) with plan=, or leave plan= out"
        )
    auto = isinstance(schedule, str) and schedule == AUTO  # chosen with the plan, below
    autosave = auto_checkpoint(checkpoint_dir, checkpoint_every)
    if autosave is not None:  # the resume's listing is bounded by the step timeout
        autosave.timeout_s = timeout
    if not auto:
        schedule = get_schedule(schedule).name
        check_nonfinite(schedule, nonfinite)
    measure = cluster is None or (isinstance(cluster, str) and cluster == MEASURED)
    cluster = None if measure else Cluster.coerce(cluster)  # every rank, before joining
    distributed = dist.is_initialized() or {"RANK", "WORLD_SIZE"} <= set(os.environ)
    rank, world_size, device = 0, 1, _local_device(model)
    if distributed:
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
            if dist.get_backend() == "nccl":  # NCCL moves CUDA tensors only
                device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = init_process_group(rank, world_size, timeout_s=startup_timeout)
    inputs = tuple(example_inputs)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        # a model without values: capture and cost it on the meta device too
        inputs, example_kwargs = _to_meta(inputs), _to_meta(example_kwargs)
    try:
        gm = trace(model, inputs, example_kwargs=example_kwargs, leaf_modules=leaf_modules,
                   batch_dims=batch_dims)  # fmt: skip
        if isinstance(plan, str):
            plan = Plan.load(plan)
    except Exception as exc:
        if distributed:
            _check_fingerprints(exc, rank, world_size, startup_timeout)  # tells the others
        raise
    # what ranks must agree on in a given plan (not, e.g., how long solving it took)
    given = [(s.nodes, s.ranks) for s in plan.stages] + [plan.schedule] if plan else None
    options = dict(schedule=schedule, num_microbatches=num_microbatches, solver=solver,
                   profile=profile, cluster=str(cluster), clip=clip_grad_norm,
                   vertical=vertical_sync, nonfinite=nonfinite, plan=given,
                   batch=global_batch_size, batch_dims=batch_dims,
                   replan=policy and (policy.after_steps, policy.threshold),
                   checkpoint_every=checkpoint_every, memory=str(memory),
                   recompute=recompute)  # fmt: skip
    if distributed:
        _check_fingerprints(_fingerprint(gm, options), rank, world_size, startup_timeout,
                            (gm, options))  # fmt: skip
    if measure and distributed and world_size > 1 and plan is None:  # before any load
        from pdcompile.runtime.cluster_measure import measure_cluster

        cluster = _collective(rank, "measuring the cluster", lambda: measure_cluster(
            rank, world_size, device, timeout_s=startup_timeout), startup_timeout)  # fmt: skip
    failure: Exception | None = None
    on_meta = any(t.is_meta for t in [*gm.parameters(), *gm.buffers()])
    # while rank 0 profiles, the other ranks on its machine train, as in the run (profile_load)
    load = ProfileLoad(rank, world_size, distributed and plan is None and profile and not on_meta,
                       startup_timeout)  # fmt: skip
    planning = plan is None and rank == 0
    if planning:
        try:
            cluster = cluster or Cluster([(world_size, DEFAULT_BANDWIDTH)])
            with load.profiling() as loaded_by:
                if isinstance(costs, str):
                    costs = CostGraph.load(costs)
                if costs is None:
                    costs = analyze(gm, inputs, example_kwargs=example_kwargs, profile=profile,
                                    optimizer=optimizer, loss_fn=loss_fn, loaded_by=loaded_by,
                                    targets=example_targets, autocast=autocast,
                                    max_rows=global_batch_size)  # fmt: skip
            plan = make_plan(costs, cluster, solver=solver, schedule=schedule,
                             num_microbatches=num_microbatches, allow_async=allow_async,
                             global_batch_size=global_batch_size, recompute=recompute,
                             memory=device_memory(memory, device, cluster.num_devices),
                             )  # fmt: skip
        except Exception as exc:
            if not distributed:
                raise
            failure = exc
    # a loading rank waits for the plan within the same startup_timeout (not once more)
    waiting = time.monotonic()
    if not planning:
        load.serve(example_step(model, inputs, example_kwargs, loss_fn, example_targets),
                   startup_timeout)  # fmt: skip
    left = max(1.0, startup_timeout - (time.monotonic() - waiting))
    shared = _share_plan(plan, failure, rank, left) if distributed else None
    # from here on every rank runs each phase, then the ranks agree on how it ended: a rank
    # that fails makes every other rank raise its error by name, not a peer's closed connection
    phase = functools.partial(_agreement, rank, world_size if distributed else 1,
                              timeout_s=startup_timeout)  # fmt: skip
    with phase("preparing the plan"):
        if shared is not None:  # rank 0's too: every rank runs the plan as it travelled
            plan = Plan.from_json(shared)
        if auto:  # what runs is the schedule the plan was made for
            schedule = plan.schedule
            check_nonfinite(schedule, nonfinite)
        if num_microbatches is not None and num_microbatches != plan.num_microbatches:
            plan = rescore(plan, num_microbatches=num_microbatches)  # what runs is scored
        updates = {"clip": clip_grad_norm is not None, "skip_nonfinite": nonfinite == "skip"}
        if any(getattr(plan, k) != v for k, v in updates.items()):
            plan = simulated(plan.with_(**updates))  # the clip and check every update runs
        if distributed:  # every rank, before its stages send anything
            check_layout(plan, world_size, world=True)
        if on_meta and policy is not None:
            raise PartitionError("replan= with a model on the meta device is not supported yet")

    def executor(plan: Plan, schedule: str, wait_s: float = startup_timeout) -> Any:
        """The executor of `plan` under `schedule` on this process: codegen, then this rank's
        stages (every rank agreeing after each: the executor's process groups are collectives,
        which a rank that failed before them would leave the others waiting in, for at most
        `wait_s`: a re-plan's move, in training, waits `timeout`)."""
        clip, skip = clip_grad_norm is not None, nonfinite == "skip"
        with phase("generating its stage modules", timeout_s=wait_s):
            program = codegen(gm, plan)
            if on_meta:
                mine = [s.index for s in plan.stages if not distributed or rank in s.ranks]
                _materialize([program.stages[i] for i in mine], device, weights)
            if distributed:  # a schedule that does not build fails here, on every rank
                program_schedule(program, schedule, plan.num_microbatches, clip, skip)
        settings = dict(schedule=schedule, num_microbatches=plan.num_microbatches,
                        loss_fn=loss_fn, optimizer=optimizer, clip_grad_norm=clip_grad_norm,
                        lr_scheduler=lr_scheduler, autocast=autocast,
                        vertical_sync=vertical_sync, nonfinite=nonfinite)  # fmt: skip
        with phase("building its executor", timeout_s=wait_s):
            if distributed:
                return DistributedPipeline(program, rank=rank, device=device,
                                           timeout_s=timeout, **settings)  # fmt: skip
            return LocalPipeline(program, **settings)

    with phase("building the pipelined module"):
        replanner = None
        if policy is not None:
            mine = None  # rank 0 decides
            if rank == 0:
                mine = CostGraph.load(costs) if isinstance(costs, str) else costs
            replanner = Replanner(policy, mine, lambda new: executor(new, schedule, timeout),
                                  {"solver": solver, "schedule": schedule})  # fmt: skip
    module = PipelinedModule(executor(plan, schedule), rank=rank, replanner=replanner,
                             checkpoint=autosave)  # fmt: skip
    if autosave is not None:
        with phase("checking that its stages can resume"):
            if len(module.pipeline.workers) != 1:  # resume raises before its collectives
                module.resume()
        with phase("resuming from the newest checkpoint"):
            module.resume()
        resume_saved_plan(module, lambda saved: executor(saved, saved.schedule), phase,
                          world_size if distributed else 1)  # fmt: skip
    if measure_memory:
        with phase("attaching the memory probe"):
            module.measure_memory()
    return module


def _materialize(
    stages: list[nn.Module],
    device: torch.device,
    weights: Callable[[], dict[str, torch.Tensor]] | str | None,
) -> None:
    """Give the stages this process runs real tensors on `device`, filled from `weights`
    (the other stages stay on the meta device: nothing of them is allocated here)."""
    if weights is None:
        raise PdcompileError(
            "the model is on the meta device: pass weights= (a function returning its state "
            "dict, or a checkpoint directory) so that each rank can fill its own stage"
        )
    if isinstance(weights, str):
        from pdcompile.runtime.checkpoint import load_full_state_dict

        state = load_full_state_dict(weights)
    else:
        state = weights()
    for stage in stages:
        aliases: dict[int, list[str]] = {}
        for name, param in stage.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        stage.to_empty(device=device)
        for names in aliases.values():  # one tensor under all its names, as before
            first = stage.get_parameter(names[0])
            for name in names[1:]:
                owner, _, attr = name.rpartition(".")
                setattr(stage.get_submodule(owner), attr, first)
        needed = stage.state_dict().keys()
        missing = [n for n in needed if n not in state]
        if missing:
            raise CheckpointError(
                f"weights= lacks {len(missing)} tensors the stage needs, e.g. {missing[:3]}; "
                "give the whole model's state dict (original names)"
            )
        stage.load_state_dict({n: state[n] for n in needed})


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def check_arguments(
    optimizer: Any,
    num_microbatches: Any,
    clip_grad_norm: Any,
    timeout: Any,
    startup_timeout: Any,
) -> None:
    """`compile`'s arguments that nothing else checks before they are used (on every rank, so
    that all raise the same error before joining).

    Raises:
        CostError: `optimizer` is not a factory `params -> torch.optim.Optimizer`, or it fails
            on one tensor (`passes.step_costs.describe_optimizer`).
        PartitionError: `num_microbatches` is no count from 1 to the cap
            (`runtime.validate.check_num_microbatches`).
        ScheduleError: `clip_grad_norm` is not a finite number > 0 (or None), a timeout not a
            finite number of seconds > 0.
    """
    from pdcompile.passes.step_costs import describe_optimizer
    from pdcompile.runtime.validate import check_num_microbatches

    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        raise CostError(
            f"optimizer must be a factory params -> torch.optim.Optimizer, which compile "
            f"applies to each stage's parameters, got {type(optimizer).__name__}; pass e.g. "
            "lambda params: torch.optim.SGD(params, lr=0.1)"
        )
    describe_optimizer(optimizer)  # a factory that fails on one tensor raises here, wrapped
    if num_microbatches is not None:
        check_num_microbatches(num_microbatches)

    def positive(value: Any) -> bool:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number and math.isfinite(value) and value > 0

    if clip_grad_norm is not None and not positive(clip_grad_norm):
        raise ScheduleError(
            f"clip_grad_norm must be a finite number > 0 (the largest gradient norm an update "
            f"applies) or None (no clipping), got {clip_grad_norm!r}"
        )
    for name, value in (("timeout", timeout), ("startup_timeout", startup_timeout)):
        if not positive(value):
            raise ScheduleError(
                f"{name} must be a finite number of seconds > 0, got {value!r}; the default is "
                f"{'300' if name == 'timeout' else '900'} s"
            )


def check_plan_arguments(
    *, solver: Any, memory: Any, recompute: Any, global_batch_size: Any, allow_async: Any
) -> None:
    """`compile`'s planning arguments, checked whatever the path (a given `plan=` uses none of
    them but the solver, for a re-plan; a bad value is a mistake all the same).

    Raises:
        PartitionError: an unknown solver, `memory` no size ('16GB', bytes > 0), "auto" or
            None (`search.recompute_choice.check_memory`), `recompute` not None/True/False,
            `global_batch_size` no integer >= 1 or None, `allow_async` not True/False.
    """
    from pdcompile.planning import SOLVERS
    from pdcompile.search.recompute_choice import check_memory, check_recompute

    SOLVERS.get(solver)
    check_memory(memory)
    check_recompute(recompute)
    g = global_batch_size
    if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < 1):
        raise PartitionError(
            f"global_batch_size must be an integer >= 1 (rows per train_step) or None, got {g!r}"
        )
    if not isinstance(allow_async, bool):
        raise PartitionError(
            f"allow_async must be True or False (whether schedule='auto' may pick pipedream or "
            f"2bw), got {allow_async!r}"
        )


def _local_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    if param is None or param.device.type == "meta":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return param.device


def _fingerprint(gm: torch.fx.GraphModule, options: dict[str, Any]) -> str:
    """A digest of what every rank must agree on: the graph's code, its tensors' names, shapes
    and dtypes, and the options."""
    digest = hashlib.sha256(gm.code.encode())
    for name, tensor in [*gm.named_parameters(), *gm.named_buffers()]:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    digest.update(repr(sorted(options.items())).encode())
    return digest.hexdigest()


def _collective(
    rank: int, what: str, run: Callable[[], Any], timeout_s: float, tag: str | None = None
) -> Any:
    """Run a start-up collective for at most `timeout_s` and return what it returns; a timeout
    or a dead rank becomes `PipelineTimeoutError` naming the ranks that never arrived, or the
    rank holding a store that stopped answering ("another rank" when none can be told:
    `runtime.bounded.collective`)."""
    from pdcompile.runtime.bounded import collective

    return collective(rank, what, run, timeout_s, tag, "did not call pdcompile.compile")


@contextlib.contextmanager
def _agreement(rank: int, world_size: int, what: str, timeout_s: float = 900.0) -> Iterator[None]:
    """Run a phase of `compile` on every rank, then agree on how it ended (one
    `all_gather_object` within `timeout_s`, also after a failure: so a phase must not start a
    collective after a point where it can fail on one rank only; after a `PipelineTimeoutError`,
    a rank at fault is gone: the others wait `AFTER_TIMEOUT_S` only, to hear of another
    failure). On one rank (`world_size` 1) just the phase.

    Raises:
        PdcompileError: on every other rank when a rank failed the phase: of the failure's
            class if that is a pdcompile error, naming the first failed rank and its message;
            the failed rank raises its own error.
        PipelineTimeoutError: a rank died or hangs (`_collective`).
    """
    if world_size == 1:
        yield
        return
    failure: Exception | None = None
    try:
        yield
    except Exception as exc:
        failure = exc
    everyone: list[str | None] = [None] * world_size
    sent = None if failure is None else f"{type(failure).__name__}: {failure}"
    if isinstance(failure, PipelineTimeoutError):
        timeout_s = min(timeout_s, AFTER_TIMEOUT_S)
    try:
        _collective(rank, f"agreeing on {what}",
                    lambda: dist.all_gather_object(everyone, sent), timeout_s)  # fmt: skip
    except PipelineTimeoutError:
        if failure is None:
            raise
        # a peer died too: this rank's own error says more than the closed connection
    if failure is not None:
        raise failure
    failed = [(r, text) for r, text in enumerate(everyone) if text is not None]
    if failed:
        first, text = failed[0]
        also = f" (ranks {[r for r, _ in failed[1:]]} failed too)" if len(failed) > 1 else ""
        raise _relayed(
            text,
            f"rank {first} failed {what}{also}, so rank {rank} stops too: {text}; the fix is "
            f"in rank {first}'s error",
        )


def _relayed(text: str, message: str) -> PdcompileError:
    """`message` as an error of the class `text` ("ClassName: ...") names, if that is a
    pdcompile error (so `except PartitionError` works on every rank), else `PdcompileError`."""
    kind = getattr(errors, text.split(":", 1)[0], None)
    if isinstance(kind, type) and issubclass(kind, PdcompileError):
        return kind(message)
    return PdcompileError(message)


def _share_plan(plan: Plan | None, failure: Exception | None, rank: int, timeout_s: float) -> str:
    """Rank 0's plan on every rank, as JSON (read in an agreed phase: `Plan.from_json` checks
    it), within `timeout_s`; rank 0's planning error stops every rank."""
    mine = plan.to_json() if plan is not None else None  # rank 0 has one, the others None
    shared = [("error", f"{type(failure).__name__}: {failure}") if failure else mine]
    what = "sending the plan to the other ranks" if rank == 0 else "receiving the plan from rank 0"
    _collective(rank, what, lambda: dist.broadcast_object_list(shared, src=0), timeout_s,
                "the plan")  # fmt: skip
    if failure is not None:
        raise failure
    if isinstance(shared[0], tuple):
        raise PdcompileError(f"rank 0 could not plan, so no rank can start: {shared[0][1]}")
    return shared[0]


def _check_fingerprints(
    mine: str | Exception,
    rank: int,
    world_size: int,
    timeout_s: float,
    capture: tuple[torch.fx.GraphModule, dict[str, Any]] | None = None,
) -> None:
    """Compare every rank's fingerprint with rank 0's; `mine` is this rank's error if it could
    not capture the model: then every rank stops (this one with its own error). When they
    differ, the ranks exchange summaries of their `capture` (graph and options) and the error
    names the first difference (`capture/graph_diff.py`)."""
    from pdcompile.capture.graph_diff import describe, first_difference

    everyone: list[str | None] = [None] * world_size
    sent = mine if isinstance(mine, str) else f"error: {type(mine).__name__}: {mine}"
    _collective(rank, "comparing graph fingerprints",
                lambda: dist.all_gather_object(everyone, sent), timeout_s)  # fmt: skip
    if isinstance(mine, Exception):
        raise mine
    failed = [(r, text) for r, text in enumerate(everyone) if text.startswith("error: ")]
    if failed:
        r, text = failed[0]
        raise PdcompileError(
            f"rank {r} could not capture the model or read its plan, so no rank can start: "
            f"{text.removeprefix('error: ')}"
        )
    differ = [r for r, other in enumerate(everyone) if other != everyone[0]]
    if differ:
        summaries: list[Any] = [None] * world_size
        summary = describe(*capture) if capture is not None else None
        _collective(rank, "comparing graphs",
                    lambda: dist.all_gather_object(summaries, summary), timeout_s)  # fmt: skip
        why = ""
        if summaries[0] is not None and summaries[differ[0]] is not None:
            why = ": " + first_difference(differ[0], summaries[differ[0]], summaries[0])
        raise PdcompileError(
            f"ranks {differ} captured another model or call than rank 0"
            + (" (this is one of them)" if rank in differ else "")
            + (
                why
                or ": every rank must call pdcompile.compile with the same model, example "
                "inputs, options and plan"
            )
        )
