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

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as dist

from pdcompile.closed_loop.decision import Decision, Replan, StageTime, decide, measured_stage_times
from pdcompile.cost_graph import CostGraph
from pdcompile.errors import PdcompileError
from pdcompile.plans import Plan
from pdcompile.runtime.checkpoint_entries import transfer
from pdcompile.runtime.executor import DistributedPipeline
from pdcompile.runtime.pipeline import Pipeline


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

    def due(self, steps: int) -> bool:
        """Whether the job decides after `steps` train steps."""
        return self.decision is None and steps == self.policy.after_steps

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
        measured = _merge(_gathered(measured_stage_times(events), distributed))
        decision: Decision | str | None = None
        if module.rank == 0:
            try:
                decision = decide(self.costs, module.plan, measured,
                                  threshold=self.policy.threshold, **self.options)  # fmt: skip
            except PdcompileError as exc:
                decision = f"{type(exc).__name__}: {exc}"
        if distributed:
            shared = [decision]
            dist.broadcast_object_list(shared, src=0)
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
            directory = self.policy.directory
            if directory is None:  # rank 0's temporary folder, on every rank (one host)
                shared = [tempfile.mkdtemp(prefix="pdcompile-replan-") if module.rank == 0
                          else None]  # fmt: skip
                dist.broadcast_object_list(shared, src=0)
                directory = shared[0]
            module.save(directory)
            old = module.pipeline
            try:
                module.pipeline = self.rebuild(plan)
                module.load(directory)
                old.close()  # its process groups: every rank moves
            except Exception as exc:
                if module.rank == 0:
                    plan.save(f"{directory}.next-plan.json")
                raise PdcompileError(
                    f"rank {module.rank}: moving to the new plan failed ({type(exc).__name__}: "
                    f"{exc}); the running plan's checkpoint {directory} is whole: restart the "
                    f"job on {directory}.next-plan.json (compile(..., plan=...), then "
                    f"load({directory!r}))"
                ) from exc
        module.restarted()


def _gathered(mine: dict[int, StageTime], distributed: bool) -> list[dict[int, StageTime]]:
    if not distributed:
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


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
