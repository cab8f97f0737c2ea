"""`WeightSlots` against `torch.func.functional_call`: same outputs and gradients, tied aliases
swapped together, the module's own parameters back afterwards (also after an error)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

import pdcompile
from pdcompile import zoo
from pdcompile.runtime.weight_slots import WeightSlots


def copies(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.detach() * 1.5).requires_grad_() for n, p in module.named_parameters()}


def test_a_captured_gpt_with_tied_weights_computes_as_functional_call_does() -> None:
    torch.manual_seed(0)
    model = zoo.GPT(zoo.GPTConfig(n_layer=2, n_embd=32, dropout=0.0)).train()
    idx = torch.randint(0, 128, (2, 8))
    gm = pdcompile.trace(model, (idx,))  # one module holding both names of the tied tensor
    names = [n for n, _ in gm.named_parameters(remove_duplicate=False)]
    assert len(names) > len(dict(gm.named_parameters()))  # an alias is there
    before = dict(gm.named_parameters())
    ours, theirs = copies(gm), copies(gm)
    out = WeightSlots(gm)(ours, (idx,), {})
    ref = functional_call(gm, theirs, (idx,))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.square().sum().backward()
    ref.square().sum().backward()
    for name in ours:
        torch.testing.assert_close(ours[name].grad, theirs[name].grad, msg=name)
    assert all(p.grad is None for p in gm.parameters())  # the live weights got nothing
    assert dict(gm.named_parameters()) == before  # the module's own parameters are back
    assert all(isinstance(p, nn.Parameter) for p in gm.parameters())


def test_the_parameters_are_back_after_an_error() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    before = dict(model.named_parameters())
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        WeightSlots(model)(copies(model), (torch.ones(1, 5),), {})
    assert dict(model.named_parameters()) == before
