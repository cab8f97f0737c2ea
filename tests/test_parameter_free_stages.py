"""Stages without parameters run (issue 31): a plan with more stages than weighted layers (a
stage holding one ReLU, as `interleaved-1f1b` cuts a 3-Linear MLP on 2 devices, and as
`schedule="auto"` may pick) trains equal to single-process gradient accumulation; its optimizer
steps do nothing and its checkpoint holds no optimizer state."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pipeline_support import OPTIMIZERS, accumulate_reference

import pdcompile

STEPS, M = 3, 4


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 64))  # fmt: skip
    return model, torch.randn(8, 64), torch.randn(8, 64)


class _Tail(nn.Module):  # uniform cuts it after fc: a last stage of tanh, softmax and log
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.relu(self.fc(x)) * 2 + 1).softmax(-1).log()


def _step_lr(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)


@pytest.mark.parametrize(
    "schedule, solver, tail",
    [("interleaved-1f1b", "dynprog", False), ("auto", "dynprog", False), ("1f1b", "uniform", True)],
)
def test_stages_without_parameters_train_as_gradient_accumulation(
    schedule: str, solver: str, tail: bool
) -> None:
    model, x, y = _mlp()
    if tail:
        torch.manual_seed(0)
        model = _Tail()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = pdcompile.compile(
            model, (x,), loss_fn=F.mse_loss, optimizer=OPTIMIZERS["adam"], cluster=2,
            schedule=schedule, solver=solver, num_microbatches=M, profile=False,
            lr_scheduler=_step_lr,
        )  # fmt: skip
    if schedule != "auto":  # the case: a stage without parameters
        assert any(not w.params for w in pipe.pipeline.workers.values())
    for _ in range(STEPS):
        loss = pipe.train_step(x, y)
    ref, ref_loss = accumulate_reference(model, x, y, F.mse_loss, OPTIMIZERS["adam"], M, STEPS,
                                         scheduler=_step_lr)  # fmt: skip
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    got = pipe.state_dict()
    for name, tensor in ref.state_dict().items():
        torch.testing.assert_close(got[name], tensor, msg=name)
