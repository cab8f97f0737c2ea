"""Inputs that are not batch-major (`batch_dims=`): a sequence-first input split along dim 1, a
table every microbatch shares whole; captured by both paths, trained equal to gradient
accumulation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile.core.errors import TraceError


class SeqFirstWithTable(nn.Module):
    """x: [T, B, 8] (sequence first), table: [5, 16] (no batch); returns [B, 5] scores."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = self.a(x.transpose(0, 1)).relu()  # [B, T, 16]
        h = self.c(self.b(h).relu()).mean(dim=1)  # [B, 16]
        return h @ table.t()  # [B, 5]


def _example(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(3, rows, 8), torch.randn(5, 16), torch.randint(0, 5, (rows,))


DIMS = {"x": 1, "table": None}


@pytest.mark.parametrize("method", ["fx", "export"])
def test_capture_takes_any_batch_along_the_named_dimension(method: str) -> None:
    torch.manual_seed(0)
    model = SeqFirstWithTable()
    x, table, _ = _example(4)
    gm = pdcompile.trace(model, (x, table), method=method, batch_dims=DIMS)
    assert dict(gm.meta["pdcompile.batch_dims"]) == DIMS
    other = torch.randn(3, 7, 8)
    torch.testing.assert_close(gm(other, table), model(other, table))
    if method == "export":  # only the batch dimension is dynamic
        with pytest.raises(TraceError, match=r"only the batch dimension is dynamic"):
            gm(torch.randn(4, 7, 8), table)


def test_batch_dims_naming_no_input_or_a_missing_dimension_is_refused() -> None:
    x, table, _ = _example(4)
    with pytest.raises(TraceError, match=r"batch_dims names 'tabel'.*did you mean 'table'"):
        pdcompile.trace(SeqFirstWithTable(), (x, table), batch_dims={"tabel": None})
    with pytest.raises(TraceError, match=r"batch_dims\['x'\] = 3, but input 'x' has 3 dim"):
        pdcompile.trace(SeqFirstWithTable(), (x, table), batch_dims={"x": 3})


def test_a_pipeline_splits_along_the_batch_dimension_and_shares_the_table() -> None:
    torch.manual_seed(0)
    model = SeqFirstWithTable()
    reference = copy.deepcopy(model)
    x, table, y = _example(8)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    pipe = pdcompile.compile(model, (x, table), loss_fn=F.cross_entropy, optimizer=sgd,
                             cluster="2", solver="uniform", num_microbatches=4, profile=False,
                             batch_dims=DIMS)  # fmt: skip
    assert len(pipe.plan.stages) == 2
    loss = pipe.train_step((x, table), y)
    # the reference: gradient accumulation over the same 4 microbatches of 2 rows
    optimizer = sgd(reference.parameters())
    total = 0.0
    for xs, ys in zip(x.chunk(4, dim=1), y.chunk(4), strict=True):
        part = F.cross_entropy(reference(xs, table), ys) * len(ys) / len(y)
        part.backward()
        total += part.item()
    optimizer.step()
    assert loss == pytest.approx(total, rel=1e-5)
    state = pipe.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=name)
