"""What the faults tier's jobs share, and its relaunch (tests/test_faults.py).

Every job of the tier trains the MLP on 3 ranks with automatic checkpoints
(`checkpoint_dir=<case>/auto`, `checkpoint_every=1`) and feeds batch k at step k (`batch`: drawn
from the step index, so a resumed job sees the data an uninterrupted one saw). After a case's
survivors ended, `relaunched` starts the same job on 3 fresh ranks with the same folder and no
fault and trains it to `STEPS`: every rank's stage (parameters, buffers, SGD momentum) must be
bit-equal (`torch.equal`) to an uninterrupted run's (`relaunched` on an empty folder), on the
plan the checkpoint it resumed recorded. `complete` and `torn` read a case's folder: the
checkpoints that verify against their manifest, and those under a checkpoint's name that do not.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.nn.functional as F

import pdcompile
from pdcompile import Cluster, CostGraph, Plan, Replan, zoo

WORLD = 3
TIMEOUT_S = 10.0  # compile's timeout in the children
STARTUP_S = 20.0  # its startup_timeout: the ranks' captures may differ by seconds on a busy host
STEPS = 4  # the relaunch and the uninterrupted runs train to this step count
FAULT_STEP = 2  # the step, save and re-plan faults come after this many steps
SLOW = 8.0  # the re-plan's measured times: stage 0 this many times its analytic cost


def model() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The MLP (no dropout: nothing random in a step) and the example batch compile traces."""
    torch.manual_seed(0)
    return zoo.MLP(p=0.0).train(), torch.randn(12, 32), torch.randint(0, 10, (12,))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of train step `step` (counted from 0), the same in every job."""
    drawn = torch.Generator().manual_seed(1000 + step)
    return torch.randn(12, 32, generator=drawn), torch.randint(0, 10, (12,), generator=drawn)


def planned() -> tuple[CostGraph, Plan]:
    """The MLP's analytic costs and a plan of one stage per rank (made once, in the parent)."""
    net, x, _ = model()
    costs = pdcompile.analyze(pdcompile.trace(net, (x,)), (x,), profile=False)
    plan = pdcompile.plan(costs, Cluster.parse(str(WORLD)), solver="uniform",
                          replica_counts=[1])  # fmt: skip
    stages = tuple(dataclasses.replace(s, ranks=(s.index,)) for s in plan.stages)
    return costs, dataclasses.replace(plan, stages=stages)


def options(auto: str, point: str, costs: CostGraph, plan: Plan, relaunch: bool = False) -> dict:
    """`compile`'s keywords for a job of `point`'s case checkpointing into `auto`.

    The profile's case plans from the loaded profile (`cluster=`); its relaunch, like every
    other job, runs `plan` (the faulted job never trained: the plan it would have made, from
    timed nodes, may differ). The re-plan's jobs measure stage 0 `SLOW` times its analytic cost
    (`Replan.timeline`), so every one of them decides the same move after `FAULT_STEP` steps."""
    chosen: dict[str, Any] = dict(
        loss_fn=F.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        timeout=TIMEOUT_S, startup_timeout=STARTUP_S, checkpoint_dir=auto, checkpoint_every=1,
    )  # fmt: skip
    if point == "profile" and not relaunch:
        chosen.update(cluster=Cluster.parse(str(WORLD)))
    else:
        chosen.update(plan=plan)
    if point == "re-plan":
        measured = lambda: _measured(plan, costs)  # noqa: E731
        chosen.update(costs=costs, replan=Replan(after_steps=FAULT_STEP, timeline=measured))
    return chosen


def _measured(plan: Plan, costs: CostGraph) -> list[Any]:
    """Synthetic recorded actions of `plan`: its stages at their analytic cost, stage 0 `SLOW`
    times slower."""
    from pdcompile.passes.planning.stage_sums import node_sums
    from pdcompile.passes.planning.timeline import Event

    events = []
    for s in plan.stages:
        sums, factor = node_sums(costs, s.nodes), SLOW if s.index == 0 else 1.0
        for r in s.ranks:
            for m in range(plan.num_microbatches):
                events += [Event(r, "F", s.index, m, 0.0, sums.forward_s * factor),
                           Event(r, "B", s.index, m, 0.0, sums.backward_s * factor)]  # fmt: skip
    return events


def join(rank: int, world_size: int, port: int) -> None:
    """Join the job's default group: a `TCPStore` in rank 0's process (no torchrun)."""
    from pdcompile.runtime.distributed import init_process_group

    os.environ.update(MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.pop("MASTER_ADDR", None)
    init_process_group(rank, world_size, timeout_s=STARTUP_S)


def complete(auto: str) -> list[int]:
    """The step counts of the checkpoints in `auto` that verify against their manifest (every
    file there, of its size and SHA-256), newest first."""
    return [steps for steps, _, problems in _checked(auto) if not problems]


def torn(auto: str) -> list[str]:
    """The checkpoints under a checkpoint's name (`step-*`) in `auto` that do not verify, with
    why: what a save must never leave (it writes aside and renames when complete)."""
    return [f"{os.path.basename(path)}: {problems[0]}" for _, path, problems in _checked(auto)
            if problems]  # fmt: skip


def _checked(auto: str) -> list[tuple[int, str, list[str]]]:
    from pdcompile.core.errors import CheckpointError
    from pdcompile.runtime import manifest
    from pdcompile.runtime.auto_resume import listed

    found = []
    for steps, path in listed(auto):
        try:
            problems = manifest.verify(path, manifest.read(path))
        except (CheckpointError, OSError) as exc:
            problems = [str(exc)]
        found.append((steps, path, problems))
    return found


def _layout(plan: Plan) -> list[Any]:
    return [(s.nodes, s.ranks, s.replicas) for s in plan.stages] + [plan.num_microbatches]


def _resumed(module: Any) -> dict[str, Any]:
    """What `compile` resumed from, and whether it runs the plan that checkpoint recorded."""
    saved, running = module.saved_plan, module.pipeline.program.plan
    same = saved is None or _layout(saved) == _layout(running)
    return {
        "from": module.resumed_from,
        "steps": module.steps,
        "skipped": sorted(module.checkpoint.skipped),
        "on its plan": module.resumed_from is None or same,
        "recorded a plan": saved is not None,
    }


def relaunched(
    rank: int,
    world_size: int,
    init_file: str,
    point: str,
    port: int,
    planned: tuple[CostGraph, Plan],
    auto: str,
    stop_at: int | None,
) -> dict[str, Any]:
    """The job of `point`'s case, no fault, trained to `STEPS` from what `auto` holds (on an
    empty folder: the uninterrupted run). With `stop_at`, the job is closed after that many
    steps and compiled again, which must resume on the plan its checkpoint recorded (the
    re-plan's: the plan it moved to). Returns what it resumed from (per compile), the plan it
    ends on, and this rank's stage: state dict and momentum buffers, by name."""
    join(rank, world_size, port)
    costs, plan = planned
    starts = []
    for leg in (0, 1):
        net, x, _ = model()
        module = pdcompile.compile(net, (x,), **options(auto, point, costs, plan, relaunch=True))
        starts.append(_resumed(module))
        for step in range(module.steps, STEPS if leg or stop_at is None else stop_at):
            module.train_step(*batch(step))
        if module.steps >= STEPS:
            break
        module.close()
    worker = next(iter(module.pipeline.workers.values()))
    momentum = {name: worker.optimizer.state[p]["momentum_buffer"].clone()
                for name, p in worker.module.named_parameters()}  # fmt: skip
    state = {name: t.detach().clone() for name, t in module.state_dict().items()}
    out = {"starts": starts, "steps": module.steps, "plan": _layout(module.pipeline.program.plan),
           "moved": getattr(module.replanner, "moved_at", None), "state": state,
           "momentum": momentum}  # fmt: skip
    module.close()
    return out


def differences(mine: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """How one rank's relaunch differs from the uninterrupted run's same rank (empty: bit-equal
    on the same plan)."""
    problems = []
    if mine["plan"] != reference["plan"]:
        problems.append(f"ends on another plan than the uninterrupted run: {mine['plan']} vs "
                        f"{reference['plan']}")  # fmt: skip
    for what in ("state", "momentum"):
        ours, theirs = mine[what], reference[what]
        if sorted(ours) != sorted(theirs):
            problems.append(f"{what} holds {sorted(ours)}, the uninterrupted run {sorted(theirs)}")
            continue
        unequal = [n for n in ours if not torch.equal(ours[n], theirs[n])]
        if unequal:
            worst = max((ours[n] - theirs[n]).abs().max().item() for n in unequal)
            problems.append(f"{what} not bit-equal: {unequal} (max |difference| {worst:.3g})")
    return problems
