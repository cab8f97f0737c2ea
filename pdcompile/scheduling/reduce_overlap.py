"""Where a replicated stage may start reducing its gradients from its last backward of the step
(`runtime/grad_buckets.py`), and how the simulator prices it. Torch-free.

A stage qualifies on a synchronous schedule when, on every replica, its last backward part adds
its gradients through autograd's accumulation (the action table's `autograd_gradients`: a fused
`B`; a split backward's `W` adds some by hand, which the hooks would miss) and no other
collective of the rank runs over the same ranks between the stage's last backward and its
`allreduce`, nor another stage of the rank reduces over them: the buckets' collectives would
interleave with those differently on each rank, and gloo and NCCL match collectives by order.

The simulator (`passes/planning/sim_engine.py`) prices the overlap simply: the gradients become
final
from the last layer to the first while the last backward runs, so on average a bucket starts
halfway through it. The all-reduce (`allreduce_s`, as before) starts when every replica is
halfway through its last backward, and the `allreduce` action ends at the later of its own start
and that reduction's end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdcompile.scheduling import Action
from pdcompile.scheduling.action_kinds import ALLREDUCE, is_compute, kind

__all__ = ["overlap_triggers"]


def overlap_triggers(actions: Mapping[int, Sequence[Action]]) -> dict[tuple[int, int], int]:
    """(rank, stage) -> the microbatch whose backward starts the stage's buckets on that rank,
    for the replicated stages of a synchronous step (`actions`: every rank's) where that is safe
    on every replica (docs in the module): each replica must issue its collectives in the same
    order."""
    local = {rank: _local_triggers(mine) for rank, mine in actions.items()}
    triggers = {}
    for rank, mine in actions.items():
        for a in mine:
            if a.kind == ALLREDUCE and a.tie < 0 and a.stage in local[rank]:
                if all(a.stage in local.get(m, {}) for m in a.group):
                    triggers[(rank, a.stage)] = local[rank][a.stage]
    return triggers


def _local_triggers(actions: Sequence[Action]) -> dict[int, int]:
    """stage -> its last backward's microbatch, where one rank's own actions allow it."""
    triggers = {}
    for i, a in enumerate(actions):
        if a.kind != ALLREDUCE or a.tie >= 0 or len(a.group) < 2:
            continue
        mine = [j for j, b in enumerate(actions[:i]) if b.stage == a.stage
                and is_compute(b.kind) and not kind(b.kind).starts]  # fmt: skip
        if not mine or not kind(actions[mine[-1]].kind).autograd_gradients:
            continue
        members = set(a.group)
        others = [
            b for b in actions[mine[-1] : i]
            if b.is_collective and set(b.group) == members and b.collective != a.collective
        ]  # fmt: skip
        shared = [  # another stage of the rank reducing over the same ranks: hooks interleave
            b for b in actions if b.kind == ALLREDUCE and b.tie < 0 and b.stage != a.stage
            and set(b.group) == members
        ]  # fmt: skip
        if not others and not shared:
            triggers[a.stage] = actions[mine[-1]].microbatch
    return triggers
