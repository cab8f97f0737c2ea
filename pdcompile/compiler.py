"""`pdcompile.compile`: any nn.Module to a pipelined one, in one call on every rank.

The lowering, top to bottom (`pdcompile/compiling/`; docs/compile.md):
0. check the settings: three frozen configs (`CaptureConfig`, `PlanConfig`, `TrainConfig`),
   each field checked once, every bad one a `ConfigError`, on every rank before it joins;
1. join the process group (torchrun's variables, or one already initialised), if any;
2. capture the model (`trace`), the same on every rank;
3. agree: a fingerprint of the graph, the call, the settings and a given plan against rank 0's
   (a rank started with another model, input, setting or plan fails here, naming it; a rank
   that could not capture tells the others, which stop too); then measure the cluster if none
   is given;
4. plan on rank 0 (costs from `analyze`, profiled while the other ranks on its machine train as
   in the run, `runtime/profile_load.py`; then `plan`; or the given `plan=`);
5. share the plan (or rank 0's error, so no rank waits for a plan that will not come), and
   prepare it on every rank;
6. build the program: the stage modules (`codegen`) and the schedule, built once;
7. build the executor: this process's rank over torch.distributed, or, without a process group,
   every rank of the plan in this process (the local executor);
8. wrap it in a `PipelinedModule` (re-planning, automatic checkpoints, the memory probe).
From step 5 on, each phase ends with the ranks agreeing on how it went (`ranks.agreement`): a
rank that fails raises its own error and every other rank one of its class naming that rank and
its message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn

    from pdcompile.compiling.pipelined_module import PipelinedModule


def compile(  # noqa: A001 - the public name API.md gives it
    model: nn.Module, example_inputs: Sequence[Any], **keywords: Any
) -> PipelinedModule:
    """Turn `model` into a pipelined module: call it the same way on every rank.

    Args:
        model: the model, in the mode to train (`model.train()`).
        example_inputs: one example call's positional inputs (a microbatch or a batch).
        keywords: the settings, each documented on its config:
            the example call and its capture (`CaptureConfig`): `example_kwargs`,
            `example_targets`, `leaf_modules`, `batch_dims`;
            planning (`PlanConfig`): `cluster`, `schedule`, `num_microbatches`, `solver`,
            `plan`, `profile`, `allow_async`, `global_batch_size`, `costs`, `memory`,
            `recompute`;
            training (`TrainConfig`): `loss_fn` and `optimizer` (both required),
            `lr_scheduler`, `clip_grad_norm`, `autocast`, `nonfinite`, `vertical_sync`,
            `timeout`, `startup_timeout`, `weights`, `replan`, `measure_memory`,
            `checkpoint_dir`, `checkpoint_every`.

    Returns:
        A `PipelinedModule`.

    Raises:
        ConfigError: an unknown, missing or bad setting (before joining, on every rank).
        PdcompileError: (a subclass saying which phase) the model cannot be captured, no plan
            fits, the ranks disagree on the model, or the plan needs more ranks than the job.

    Example:
        >>> model, (x,) = pdcompile.zoo.mlp()[:2]  # 4 rows, 10 classes
        >>> pipe = pdcompile.compile(model, (x,), loss_fn=F.cross_entropy, cluster="2",
        ...                          solver="uniform", optimizer=lambda p: SGD(p, lr=0.1))
        >>> pipe.plan.num_stages, pipe.train_step(x, torch.tensor([0, 1, 2, 3])) > 0
        (2, True)
    """
    from pdcompile.compiling.build import Builder, wrap
    from pdcompile.compiling.ranks import join
    from pdcompile.compiling.settings import compile_settings
    from pdcompile.compiling.steps import agree, capture, plan_on_rank_0, share
    from pdcompile.core.generators import generators_kept

    settings = compile_settings(example_inputs, keywords)  # every rank, before joining
    job = join(model, settings.train.startup_timeout)
    with generators_kept(job.device):  # training's dropout masks: whatever ran here
        captured = capture(model, settings, job)
        cluster = agree(captured, settings, job)
        planned = plan_on_rank_0(model, captured, settings, cluster, job)
        plan, rules = share(planned, captured, settings, job)
        builder = Builder(captured, settings, job)
        program, built = builder.program(plan, rules)
        executor = builder.executor(program, built, rules)
    return wrap(builder, executor, rules, planned.costs)
