"""`trace` checks the backward too, and rewrites the writes into fresh tensors that export leaves
without a derivative (DeepseekV3's multi-head latent attention)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import pdcompile
from pdcompile.core.errors import TraceError


class NoDerivative(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.ops.aten.copy.default(torch.zeros_like(h), h))


def test_a_graph_without_a_backward_is_refused_naming_the_node_and_line() -> None:
    line = r"\(at .*test_capture_backward.py:\d+: return self.b\(torch.ops"
    with pytest.raises(
        TraceError, match=r"not the backward.*aten::copy.*at node copy_default " + line
    ):
        pdcompile.trace(NoDerivative(), (torch.randn(2, 4),), method="fx")
    # an eval-mode capture trains nothing: no backward is asked of it
    pdcompile.trace(NoDerivative().eval(), (torch.randn(2, 4),), method="fx")


class Latent(nn.Module):
    """Keys assembled by writing two parts into a fresh tensor, as DeepseekV3 does."""

    def __init__(self) -> None:
        super().__init__()
        self.nope, self.rope = nn.Linear(6, 8), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = x.new_empty(x.shape[0], 12)
        keys[..., :8].copy_(self.nope(x))
        keys[..., 8:].copy_(self.rope(x).double())  # the copy casts too
        return keys.tanh()


def test_writes_into_a_fresh_tensor_train_like_the_model() -> None:
    torch.manual_seed(0)
    model, x = Latent(), torch.randn(3, 6)
    gm = pdcompile.trace(model, (x,))
    assert gm.meta["pdcompile.capture"] == "export"
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy.default)
    expected = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    actual = torch.autograd.grad(gm(x).square().sum(), list(gm.parameters()))
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)
    assert torch.equal(gm(x[:1]), model(x[:1]))  # another batch size


def test_exported_batch_norm_trains_and_updates_its_statistics() -> None:
    # export writes the new running statistics into the buffers batch norm saved for its
    # backward; capture points the reads at copies so that the backward still runs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    reference = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 8, 8)
    gm = pdcompile.trace(model, (x,), method="export")
    actual = torch.autograd.grad(gm(x).square().sum(), list(gm.parameters()))
    expected = torch.autograd.grad(reference(x).square().sum(), list(reference.parameters()))
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)
    torch.testing.assert_close(gm.state_dict()["1.running_mean"], reference[1].running_mean)
