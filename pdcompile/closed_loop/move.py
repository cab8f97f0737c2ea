"""`compile(..., replan=True)`: a running job measures its stages, re-plans, and moves.

After `Replan.after_steps` train steps every rank reduces its recorded actions to per-stage
times (`replan.measured_stage_times`) and the ranks share them; rank 0, which holds the
CostGraph, decides (`replan.decide`) and tells every rank. To move, the running plan is
checkpointed (`PipelinedModule.save`: atomic, so a rank dying during the move leaves it whole),
every rank builds its stage of the new plan (codegen, a fresh executor) and loads the checkpoint
by name (`PipelinedModule.load`: parameters, optimizer state, step and update counts), and the
schedule starts again. In one process the move hands the state over in memory, by name
(`checkpoint_entries.transfer`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as dist

from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import CheckpointError, PdcompileError
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.replan_decision import (
    Decision,
    Replan,
    StageTime,
    decide,
    measured_stage_times,
)
from pdcompile.runtime.bounded import collective
from pdcompile.runtime.checkpoint_entries import transfer
from pdcompile.runtime.executor import DistributedPipeline
from pdcompile.runtime.manifest_format import MANIFEST
from pdcompile.runtime.pipeline import Pipeline

log = logging.getLogger(__name__)


def check_folder(directory: str | None) -> None:
    """Refuse a `Replan.directory` holding files that are not a checkpoint's: the move replaces
    the whole folder.

    Raises:
        CheckpointError: the folder holds other files.
    """
    held = os.listdir(directory) if directory is not None and os.path.isdir(directory) else []
    if held and MANIFEST not in held:
        raise CheckpointError(
            f"Replan.directory={directory!r} holds {sorted(held)[:3]}, which are not a "
            "checkpoint's files, and the move replaces the whole folder: give a new or empty "
            "folder, or None"
        )


@dataclass
class Replanner:
    """What a `PipelinedModule` needs to re-plan: the policy, rank 0's CostGraph (None on the
    others), how to build the executor of a plan, and `plan()`'s options (solver, ...)."""

    policy: Replan
    costs: CostGraph | None
    rebuild: Callable[[Plan], Pipeline]
    options: dict[str, Any] = field(default_factory=dict)
    decision: Decision | None = None
    moved_at: int | None = None  # the train steps run before the move
    move_s: float = 0.0  # seconds the move took on this rank (checkpoint, build, load)

    resumed: str | None = None  # a checkpoint of the plan this job moved to, resumed on it

    def __post_init__(self) -> None:
        check_folder(self.policy.directory)

    def due(self, steps: int) -> bool:
        """Whether the job decides after `steps` train steps: once, at the first step from
        `after_steps` on (a job resumed past it decides at its first step), never on a job
        resumed on the plan it moved to."""
        undecided = self.decision is None and self.resumed is None
        return undecided and steps >= self.policy.after_steps

    def run(self, module: Any) -> None:
        """Measure, decide on rank 0, and move every rank if rank 0 says so (`module` is the
        `PipelinedModule`; every rank calls this after the same step)."""
        pipeline = module.pipeline
        distributed = isinstance(pipeline, DistributedPipeline)
        if self.policy.timeline is not None:  # given instead of the recorded actions
            mine = set(pipeline.workers)
            events = [e for e in self.policy.timeline() if (e.rank, e.stage) in mine]
        else:
            since = module.step_start(1 if self.policy.after_steps > 1 else 0)
            events = [e for w in pipeline.workers.values() for e in w.timeline
                      if e.start >= since]  # fmt: skip
        measured = _merge(_gathered(measured_stage_times(events), module, distributed))
        decision: Decision | str | None = None
        if module.rank == 0:
            try:
                decision = decide(self.costs, module.plan, measured,
                                  threshold=self.policy.threshold, **self.options)  # fmt: skip
            except PdcompileError as exc:
                decision = f"{type(exc).__name__}: {exc}"
        if distributed:
            shared = [decision]
            _bounded(module, "receiving the re-plan decision from rank 0" if module.rank else
                     "sending the re-plan decision", "the re-plan decision",
                     lambda: dist.broadcast_object_list(shared, src=0))  # fmt: skip
            decision = shared[0]
        if isinstance(decision, str):
            raise PdcompileError(f"rank 0 could not re-plan from the measured stages: {decision}")
        assert decision is not None
        stacked = [p for p in (module.plan, decision.new)
                   if sum(s.replicas for s in p.stages) > p.num_devices_used]  # fmt: skip
        if decision.move and distributed and stacked:  # every rank sees the same plans
            decision = replace(decision, move=False, reason=(
                "a rank of a plan runs several stages, and the move checkpoints one stage per "
                "rank: staying"))  # fmt: skip
        self.decision = decision
        if decision.move:
            start = time.perf_counter()
            self._move(module, decision.new, distributed)
            self.moved_at, self.move_s = module.steps, time.perf_counter() - start

    def _move(self, module: Any, plan: Plan, distributed: bool) -> None:
        if not distributed:
            old = module.pipeline
            old.flush()
            module.pipeline = self.rebuild(plan)
            transfer(old.workers.values(), module.pipeline.workers.values())
        else:
            self._move_ranks(module, plan)
        module.restarted()

    def _move_ranks(self, module: Any, plan: Plan) -> None:
        """Checkpoint the running plan, build `plan`'s stages and load it, on every rank; a
        temporary folder (no `Replan.directory`) is removed after, whatever happened."""
        directory, temporary = self.policy.directory, self.policy.directory is None
        if temporary:  # rank 0's temporary folder, on every rank (one host)
            shared = [tempfile.mkdtemp(prefix="pdcompile-replan-") if module.rank == 0
                      else None]  # fmt: skip
            _bounded(module, "sharing the move's folder", "the move's folder",
                     lambda: dist.broadcast_object_list(shared, src=0))  # fmt: skip
            directory = shared[0]
        try:
            self._save_load(module, plan, directory, temporary)
        finally:
            if temporary and module.rank == 0:
                shutil.rmtree(directory, ignore_errors=True)

    def _save_load(self, module: Any, plan: Plan, directory: str, temporary: bool) -> None:
        """`_move_ranks` in `directory`: a failure names the move and what is left."""
        try:
            module.save(directory)
        except Exception as exc:
            raise _named(
                exc,
                f"rank {module.rank}: the move to the new plan (decided after step "
                f"{module.steps}) stopped while the ranks checkpointed the running plan into "
                f"{directory}: {type(exc).__name__}: {exc}. No rank moved and that checkpoint "
                "was not completed (one saved there before stays whole); restart the job from its "
                "last checkpoint (compile(checkpoint_dir=...) resumes by itself)",
            ) from exc
        old = module.pipeline
        try:
            module.pipeline = self.rebuild(plan)
            module.load(directory)
            old.close()  # its process groups: every rank moves
        except Exception as exc:
            if temporary:  # removed by the caller: the job's own checkpoints are what is left
                left = ("the move's temporary checkpoint is removed: restart the job from its "
                        "last checkpoint (compile(checkpoint_dir=...) resumes by itself, on the "
                        "plan it saved), or pass Replan(directory=...) to keep the move's "
                        "checkpoint")  # fmt: skip
            else:
                if module.rank == 0:
                    plan.save(f"{directory}.next-plan.json")
                left = (f"the running plan's checkpoint {directory} is whole: restart the job on "
                        f"{directory}.next-plan.json (compile(..., plan=...), then "
                        f"load({directory!r}))")  # fmt: skip
            raise _named(
                exc,
                f"rank {module.rank}: moving to the new plan failed ({type(exc).__name__}: "
                f"{exc}); {left}",
            ) from exc


def resume_saved_plan(
    module: Any, build: Callable[[Plan], Pipeline], phase: Callable[[str], Any], world_size: int
) -> None:
    """After `PipelinedModule.resume` (every rank): when the checkpoint was saved running
    another plan than the one this job starts on (the closed loop had moved, or the job is
    restarted with another plan), move onto the checkpoint's plan, as the job ran it: build its
    stages (`build`), load the checkpoint again, and say so (`resumed_note`, logged, in
    `explain()`). A checkpoint's plan this job cannot run (another world size or model) leaves
    the job on its own plan, with a warning. `phase`: compile's agreement of the ranks."""
    from pdcompile.passes.planning.validate import check_layout
    from pdcompile.scheduling import check_nonfinite

    saved, running, path = module.saved_plan, module.pipeline.program.plan, module.resumed_from
    if saved is None or path is None or _layout(saved) == _layout(running):
        return
    theirs, ours = _shapes(saved), _shapes(running)
    try:
        if sorted(n for s in saved.stages for n in s.nodes) != sorted(
            n for s in running.stages for n in s.nodes
        ):
            raise PdcompileError("its stages hold other nodes than this model's graph")
        check_layout(saved, world_size, world=True)
        check_nonfinite(saved.schedule, "skip" if running.skip_nonfinite else "raise")
    except PdcompileError as exc:
        module.resumed_note = (f"resumed from {path} on the plan compile made ({ours}), not on "
                               f"the one the checkpoint was saved running ({theirs}), which this "
                               f"job cannot run: {exc}")  # fmt: skip
        log.warning("%s", module.resumed_note)
        return
    old = module.pipeline
    module.pipeline = build(saved)
    with phase("loading the checkpoint into the plan it was saved running"):
        module.load(path)
        old.close()
    module.restarted()
    moved = module.saved_moved_at
    if moved is not None and module.replanner is not None:  # the closed loop had decided
        module.replanner.resumed, module.replanner.moved_at = path, moved
    how = f"the plan the job moved to after step {moved}" if moved is not None else "its plan"
    module.resumed_note = (f"resumed from {path} on {how} ({theirs}), as the checkpoint was "
                           f"saved running, not on the plan compile made now ({ours})")  # fmt: skip
    log.info("rank %d: %s", module.rank, module.resumed_note)


def _layout(plan: Plan) -> list[Any]:
    return [(s.nodes, s.ranks) for s in plan.stages] + [plan.schedule]


def _shapes(plan: Plan) -> str:
    stages = " | ".join(f"{len(s.nodes)} nodes x{s.replicas}" for s in plan.stages)
    return f"stages {stages}, {plan.schedule}"


def _named(exc: Exception, message: str) -> PdcompileError:
    """A move's failure: `message` as the cause's class, if a pdcompile error."""
    return (type(exc) if isinstance(exc, PdcompileError) else PdcompileError)(message)


def _gathered(
    mine: dict[int, StageTime], module: Any, distributed: bool
) -> list[dict[int, StageTime]]:
    if not distributed:
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    _bounded(module, "sharing the measured stage times", None,
             lambda: dist.all_gather_object(everyone, mine))  # fmt: skip
    return everyone


def _bounded(module: Any, what: str, tag: str | None, run: Callable[[], Any]) -> Any:
    """A collective of the re-plan within the step timeout (the default group's is the start-up
    one), naming the ranks that never reached it (`runtime.bounded.collective`)."""
    timeout_s = module.pipeline.comm.timeout_s
    return collective(module.rank, what, run, timeout_s, tag, culprit="failed before the re-plan")


def _merge(parts: list[dict[int, StageTime]]) -> dict[int, StageTime]:
    """Per stage, the replicas' medians averaged by their microbatch counts."""
    merged: dict[int, StageTime] = {}
    for part in parts:
        for s, t in part.items():
            if s in merged:
                m, n = merged[s], merged[s].count + t.count
                t = StageTime((m.forward_s * m.count + t.forward_s * t.count) / n,
                              (m.backward_s * m.count + t.backward_s * t.count) / n, n)  # fmt: skip
            merged[s] = t
    return dict(sorted(merged.items()))
