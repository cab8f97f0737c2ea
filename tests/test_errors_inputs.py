"""Inputs pdcompile cannot take: example inputs at capture, batches and targets at train time.

Covered elsewhere: example inputs that do not fit the signature, that are not a tuple, or that
hide tensors in a list (tests/test_capture.py::test_bad_example_inputs_are_clear_errors), and a
batch with fewer rows than microbatches
(tests/test_local_executor.py::test_a_batch_too_small_for_the_microbatches_is_refused).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pdcompile
from pdcompile import zoo
from pdcompile.core.errors import BatchError, CheckpointError, LossError, TraceError

SGD = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731


def test_example_inputs_of_the_wrong_type_shape_or_device_are_trace_errors() -> None:
    model = zoo.MLP(p=0.0)
    with pytest.raises(TraceError, match="no tensor among the example inputs of MLP"):
        pdcompile.trace(model, (torch.randn(8, 32).numpy(),))
    with pytest.raises(TraceError) as info:
        pdcompile.trace(model, (torch.randn(8, 31),))
    message = str(info.value)
    assert "does not run on the example inputs (x: float32[8, 31] on cpu)" in message
    assert "at node net_0" in message and "mat1 and mat2 shapes cannot be multiplied" in message
    assert "pass example inputs MLP accepts" in message
    with pytest.raises(TraceError, match="example input 'x' is on meta but MLP's parameters are"):
        pdcompile.trace(model, (torch.randn(8, 32, device="meta"),))


@pytest.fixture(scope="module")
def pipe():
    """An MLP cut in two stages (4 microbatches), trained by the local executor."""
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    return pdcompile.compile(zoo.MLP(p=0.0), (x,), loss_fn=F.cross_entropy, optimizer=SGD,
                             cluster="2", solver="uniform", profile=False)  # fmt: skip


@pytest.mark.parametrize(
    "batch, words",
    [
        (
            torch.randn(8, 31),
            "input 'x' is float32[8, 31], but MLP was captured with float32[",
        ),
        (torch.randn(8, 32).double(), "input 'x' is float64[8, 32]"),
        (torch.randn(8, 32).numpy(), "input 'x' is a numpy.ndarray (torch.from_numpy converts"),
        (torch.randn(8, 32, device="meta"), "input 'x' is on meta but stage 0 runs on cpu"),
        ((torch.randn(8, 32), torch.randn(8, 32)), "2 positional inputs given, but MLP was"),
    ],
)
def test_a_batch_the_plan_cannot_take_is_a_batch_error(pipe, batch, words) -> None:
    y = torch.randint(0, 10, (8,))
    with pytest.raises(BatchError) as info:
        pipe.train_step(batch, y)
    assert words in str(info.value)
    with pytest.raises(BatchError):
        pipe.eval_step(batch)


def test_a_larger_batch_is_taken_and_other_rows_are_split(pipe) -> None:
    for rows in (8, 13, 32):
        loss = pipe.train_step(torch.randn(rows, 32), torch.randint(0, 10, (rows,)))
        assert torch.isfinite(torch.tensor(loss))
    assert pipe.eval_step(torch.randn(13, 32)).shape == (13, 10)


def test_a_state_dict_without_the_stage_tensors_is_refused(pipe) -> None:
    with pytest.raises(CheckpointError, match=r"lacks 3 tensors stage 0 holds, e.g. \['net.0.b"):
        pipe.load_state_dict({"net.0.weight": torch.zeros(64, 32)})


def test_targets_missing_on_the_last_stage(pipe) -> None:
    x = torch.randn(8, 32)
    with pytest.raises(BatchError, match="targets have 4 rows but the inputs have 8"):
        pipe.train_step(x, torch.randint(0, 10, (4,)))
    with pytest.raises(LossError) as info:  # the step stops midway: the module's last use
        pipe.train_step(x, None)
    message = str(info.value)
    assert "loss_fn raised TypeError at stage 1 (rank 1), microbatch 0" in message
    assert "the microbatch's targets (None)" in message
