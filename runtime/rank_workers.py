"""One rank's stage workers: a rank may run several stages (a replica of each), one
`StageWorker` per stage, sharing the rank's communication.

Actions go to the worker of their stage. A rank takes part in a rank-wide collective (`check`,
`clip` over a group) once for all its stages, one stage or several: their flags or squared
norms are combined here, and one all-reduce gives every worker the result. So does a tied
tensor with copies on several of the rank's stages (the first and last stage of `zb-v`): the
copies' gradients are summed here, all-reduced with the other ranks holding it, and given back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from pdcompile.passes.planning.timeline import Event
from pdcompile.runtime.worker import StageWorker, ensure_grad
from pdcompile.scheduling import Action
from pdcompile.scheduling.action_kinds import ALLREDUCE, CHECK, CLIP

RANK_WIDE = (CHECK, CLIP)  # with a group: one all-reduce per rank, however many stages


class RankWorkers:
    """The workers of one rank, by stage."""

    def __init__(self, rank: int, workers: dict[int, StageWorker]) -> None:
        self.rank = rank
        self.by_stage = dict(sorted(workers.items()))
        self.comm = next(iter(self.by_stage.values())).comm

    def __iter__(self) -> Iterator[StageWorker]:
        return iter(self.by_stage.values())

    def run(self, a: Action) -> None:
        if a.kind in RANK_WIDE and a.group:
            self._together(a)
        elif a.kind == ALLREDUCE and a.tie >= 0 and len(self._holders(a.tie)) > 1:
            self._tie(a)
        else:
            self.by_stage[a.stage].run(a)

    def _holders(self, tie: int) -> list[StageWorker]:
        """This rank's workers holding a copy of tied tensor `tie`."""
        return [w for w in self if w.tied[tie]]

    def _tie(self, a: Action) -> None:
        """A tied tensor with copies on several of this rank's stages: their gradients summed
        here, with the other ranks' (one all-reduce), and every copy given the sum, so the
        copies stay equal."""
        holders, start = self._holders(a.tie), time.perf_counter()
        grads = []
        for worker in holders:
            worker.versions.collect()
            grads.append(ensure_grad(worker.params[worker.tied[a.tie][0]]))
        total = grads[0].clone()
        for grad in grads[1:]:
            total += grad
        if len(a.group) > 1:
            self.comm.all_reduce([total], a.group, a.collective)
        for grad in grads:
            grad.copy_(total)
        owner = self.by_stage[a.stage]
        if owner.timeline is not None:
            owner.timeline.append(Event(
                self.rank, a.kind, a.stage, a.microbatch, start, time.perf_counter(), a.peer
            ))  # fmt: skip

    def finish(self, a: Action) -> None:
        if a.kind in RANK_WIDE and a.group:
            for worker in self:
                worker.finish(a)
        else:
            self.by_stage[a.stage].finish(a)

    def expect(self, a: Action) -> None:
        self.by_stage[a.stage].expect(a)

    def _together(self, a: Action) -> None:
        """One all-reduce for the rank: whether any of its stages computed a NaN or infinite
        loss in the step (`check`: the step is then skipped everywhere), or the sum of its
        stages' squared gradient norms (`clip`); recorded on the timeline of `a`'s stage."""
        workers, start = list(self), time.perf_counter()
        device = workers[0].tensor_device()
        if a.kind == CHECK:
            value = float(any(w.nonfinite_loss() for w in workers))
            total = torch.tensor([value], device=device)
        else:
            value = sum(w.clip_squares(a) for w in workers)
            total = torch.tensor([value], dtype=torch.float64, device=device)
        self.comm.all_reduce([total], a.group, a.collective)
        for worker in workers:
            if a.kind == CHECK:
                worker.nonfinite_flag = total
            else:
                worker.norm_squares = total
        owner = self.by_stage[a.stage]
        if owner.timeline is not None:
            owner.timeline.append(Event(
                self.rank, a.kind, a.stage, a.microbatch, start, time.perf_counter(), a.peer
            ))  # fmt: skip
