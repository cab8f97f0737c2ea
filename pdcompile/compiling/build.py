"""`compile`'s last steps: a plan's program and executor on this process, and the module that
wraps them (re-planning, automatic checkpoints and resume, the memory probe)."""

from __future__ import annotations

from dataclasses import dataclass

from pdcompile.compiling.pipelined_module import PipelinedModule
from pdcompile.compiling.ranks import Job, Phase
from pdcompile.compiling.settings import Settings
from pdcompile.compiling.steps import Captured
from pdcompile.compiling.weights import materialize
from pdcompile.core.cost_graph import CostGraph
from pdcompile.lowering.staged_program import StagedProgram
from pdcompile.passes.planning.plans import Plan
from pdcompile.runtime.pipeline import Pipeline
from pdcompile.scheduling import PipelineSchedule, Schedule


@dataclass(frozen=True)
class Builder:
    """Builds a plan's stages and executor on this process, every rank agreeing after each
    phase (the executor's process groups are collectives, which a rank that failed before them
    would leave the others waiting in): for `compile`, a re-plan's move and a resume onto the
    plan a checkpoint was saved running."""

    captured: Captured
    settings: Settings
    job: Job

    @property
    def phase(self) -> Phase:
        """The ranks' agreement on a phase (`ranks.agreement`), under the start-up timeout."""
        return self.job.phase(self.settings.train.startup_timeout)

    def program(
        self, plan: Plan, rules: PipelineSchedule, wait_s: float | None = None
    ) -> tuple[StagedProgram, Schedule]:
        """The stage modules of `plan` (`codegen`; this rank's filled from `weights=` for a
        model on the meta device) and its schedule under `rules`, built once (a schedule that
        does not build fails here, on every rank); agreed within `wait_s` (default: the
        start-up timeout)."""
        from pdcompile.lowering.stage_codegen import codegen
        from pdcompile.runtime.pipeline import program_schedule

        job, train = self.job, self.settings.train
        with self.phase("generating its stage modules", timeout_s=wait_s or train.startup_timeout):
            program = codegen(self.captured.gm, plan)
            if self.captured.on_meta:
                mine = [s.index for s in plan.stages if not job.distributed or job.rank in s.ranks]
                materialize([program.stages[i] for i in mine], job.device, train.weights)
            built = program_schedule(program, rules, plan.num_microbatches, train.clip,
                                     train.skip_nonfinite)  # fmt: skip
        return program, built

    def executor(
        self,
        program: StagedProgram,
        built: Schedule,
        rules: PipelineSchedule,
        wait_s: float | None = None,
    ) -> Pipeline:
        """This process's executor of `program` walking `built`: this rank's stages over
        torch.distributed, or every rank in this process."""
        from pdcompile.runtime.executor import DistributedPipeline
        from pdcompile.runtime.local import LocalPipeline

        job, train = self.job, self.settings.train
        with self.phase("building its executor", timeout_s=wait_s or train.startup_timeout):
            if job.distributed:
                return DistributedPipeline(program, rank=job.rank, device=job.device,
                                           schedule=rules, config=train, built=built)  # fmt: skip
            return LocalPipeline(program, schedule=rules, config=train, built=built)

    def rebuild(
        self, plan: Plan, rules: PipelineSchedule | None = None, wait_s: float | None = None
    ) -> Pipeline:
        """The executor of another plan (under `rules`, default the plan's schedule)."""
        rules = rules or plan.rules
        program, built = self.program(plan, rules, wait_s)
        return self.executor(program, built, rules, wait_s)


def wrap(
    builder: Builder, executor: Pipeline, rules: PipelineSchedule, costs: CostGraph | None
) -> PipelinedModule:
    """The `PipelinedModule` of `executor`: with the closed loop (`replan=`: rank 0 keeps the
    `costs` it planned with, or reads `costs=`), automatic checkpoints (resuming from the
    newest, and moving onto the plan it was saved running), and the memory probe."""
    from pdcompile.closed_loop.move import Replanner, resume_saved_plan
    from pdcompile.runtime.auto_resume import AutoCheckpoint

    settings, job, phase = builder.settings, builder.job, builder.phase
    train = settings.train
    replanner = None
    with phase("building the pipelined module"):
        if train.replan is not None:
            if job.rank == 0 and costs is None:
                given = settings.plan.costs
                costs = CostGraph.load(given) if isinstance(given, str) else given
            replanner = Replanner(
                train.replan, costs if job.rank == 0 else None,
                lambda new: builder.rebuild(new, rules, train.timeout),
                {"solver": settings.plan.solver, "schedule": rules.name},
            )  # fmt: skip
    autosave = None
    if train.checkpoint_dir is not None:  # the resume's listing is bounded by the step timeout
        autosave = AutoCheckpoint(train.checkpoint_dir, train.checkpoint_every,
                                  timeout_s=train.timeout)  # fmt: skip
    module = PipelinedModule(executor, rank=job.rank, replanner=replanner, checkpoint=autosave)
    if autosave is not None:
        with phase("checking that its stages can resume"):
            if len(module.pipeline.workers) != 1:  # resume raises before its collectives
                module.resume()
        with phase("resuming from the newest checkpoint"):
            module.resume()
        resume_saved_plan(module, builder.rebuild, phase, job.world_size if job.distributed else 1)
    if train.measure_memory:
        with phase("attaching the memory probe"):
            module.measure_memory()
    return module
