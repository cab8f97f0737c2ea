"""Models pdcompile cannot take: each gives its error class and says what and where.

Covered elsewhere: a model no path can capture
(tests/test_capture.py::test_no_capture_path_gives_one_error_with_both_reasons) and a model whose
Python takes another path than the one captured
(tests/test_capture.py::test_a_graph_that_computes_something_else_is_refused).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile import zoo
from pdcompile.core.errors import CostError, LossError, TraceError

SGD = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731


class _Flaky(nn.Module):
    """A leaf that runs `budget` more times, then fails (state that changes between calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.budget = 1000

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.budget -= 1
        if self.budget < 0:
            raise RuntimeError("the sensor is closed")
        return x * 2


class _WithFlaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.flaky = _Flaky()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flaky(self.fc(x))


def test_a_leaf_that_cannot_run_again_names_the_node_and_the_way_out() -> None:
    model, x = _WithFlaky(), torch.randn(4, 8)
    gm = pdcompile.trace(model, (x,), leaf_modules=[_Flaky])
    gm.flaky.budget = 0  # the cost passes run every node again: this one refuses
    with pytest.raises(CostError) as info:
        pdcompile.analyze(gm, (x,), profile=False)
    message = str(info.value)
    assert "at node flaky (_Flaky)" in message and "the sensor is closed" in message
    assert "leave it out of leaf_modules" in message


class _Inplace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(x)


def test_a_model_that_updates_its_input_in_place_is_refused_and_the_input_kept() -> None:
    x = torch.randn(4, 8)
    before = x.clone()
    with pytest.raises(TraceError) as info:
        pdcompile.trace(_Inplace(), (x,), method="fx")
    message = str(info.value)
    assert "_Inplace changes its input 'x' in place at node mul_" in message
    assert "test_errors_model.py" in message and "x.mul_(2)" in message  # the user's line
    assert torch.equal(x, before)
    with pytest.raises(TraceError, match="changes its input 'x' in place"):
        pdcompile.trace(_Inplace(), (x,))  # every capture path says so


class _DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = zoo.MLP(p=0.0)

    def forward(self, x: torch.Tensor) -> dict:
        return {"logits": self.mlp(x), "scale": 2}


def test_outputs_that_are_not_the_tensor_the_loss_needs_are_a_loss_error() -> None:
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    pipe = pdcompile.compile(_DictOut(), (x,), loss_fn=F.cross_entropy, optimizer=SGD,
                             cluster="2", solver="uniform", profile=False)  # fmt: skip
    with pytest.raises(LossError) as info:
        pipe.train_step(x, y)
    message = str(info.value)
    assert "loss_fn raised TypeError at stage 1 (rank 1), microbatch 0 of step 0" in message
    assert "dict with keys ['logits', 'scale']" in message and "Tensor int64[2]" in message

    per_row = lambda out, t: F.cross_entropy(out["logits"], t, reduction="none")  # noqa: E731
    pipe = pdcompile.compile(_DictOut(), (x,), loss_fn=per_row, optimizer=SGD, profile=False)
    with pytest.raises(
        LossError, match=r"returned Tensor float32\[4\] at stage 0 .* scalar tensor"
    ):
        pipe.train_step(x, y)
