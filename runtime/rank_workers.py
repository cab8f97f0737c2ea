"""One rank's stage workers: a rank may run several stages (a replica of each), one
`StageWorker` per stage, sharing the rank's communication.

Actions go to the worker of their stage. A rank takes part in a rank-wide collective (`check`,
`clip` over a group) once for all its stages: their flags or squared norms are combined here,
and one all-reduce gives every worker the result.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pdcompile.runtime.worker import StageWorker
from pdcompile.schedules import Action


class RankWorkers:
    """The workers of one rank, by stage."""

    def __init__(self, rank: int, workers: dict[int, StageWorker]) -> None:
        self.rank = rank
        self.by_stage = dict(sorted(workers.items()))
        self.comm = next(iter(self.by_stage.values())).comm

    def __iter__(self) -> Iterator[StageWorker]:
        return iter(self.by_stage.values())

    def run(self, a: Action) -> None:
        if len(self.by_stage) > 1 and a.kind in ("check", "clip") and a.group:
            self._together(a)
        else:
            self.by_stage[a.stage].run(a)

    def finish(self, a: Action) -> None:
        if len(self.by_stage) > 1 and a.kind in ("check", "clip") and a.group:
            for worker in self:
                worker.finish(a)
        else:
            self.by_stage[a.stage].finish(a)

    def expect(self, a: Action) -> None:
        self.by_stage[a.stage].expect(a)

    def _together(self, a: Action) -> None:
        """One all-reduce for the rank: any stage's non-finite loss, or the sum of its stages'
        squared norms."""
        workers = list(self)
        device = workers[0].tensor_device()
        if a.kind == "check":
            value = float(any(w.nonfinite_loss() for w in workers))
            total = torch.tensor([value], device=device)
        else:
            value = sum(w.clip_squares(a) for w in workers)
            total = torch.tensor([value], dtype=torch.float64, device=device)
        self.comm.all_reduce([total], a.group, a.collective)
        for worker in workers:
            if a.kind == "check":
                worker.nonfinite_flag = total
            else:
                worker.norm_squares = total
