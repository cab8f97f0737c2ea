"""Capture never degrades silently: a dominant automatic leaf is reported with every path's
error, and `use_cache` is bound through `**kwargs` where the model's config has it."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

import pdcompile
from pdcompile.core.errors import TraceWarning


class Branchy(nn.Module):
    """Control flow on a tensor's value: neither symbolic tracing nor export follows it."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.big(x)
        return h * 2 if h.sum() > 0 else h


class MostlyBranchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = Branchy(), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_a_dominant_leaf_is_reported_with_its_share_and_exports_error() -> None:
    with pytest.warns(TraceWarning) as seen:
        gm = pdcompile.trace(MostlyBranchy(), (torch.randn(4, 16),))
    assert gm.meta["pdcompile.capture"] == "fx"
    text = "\n".join(str(w.message) for w in seen)
    assert "one leaf holding most of the model" in text
    assert "'body'" in text and "89% of the parameters" in text
    assert "torch.export, tried next, failed" in text and "data-dependent" in text.lower()


class CachedByConfig(nn.Module):
    """Takes `use_cache` only through **kwargs, defaulting to its config (GraniteMoe)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(use_cache=True)
        self.net = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, **kwargs: object) -> object:
        out = self.net(x)
        if kwargs.get("use_cache", self.config.use_cache):
            return out, object()  # a cache object: no graph can return it
        return out


@pytest.mark.parametrize("method", ["fx", "export"])
def test_use_cache_is_bound_through_kwargs_when_the_config_has_it(method: str) -> None:
    gm = pdcompile.trace(CachedByConfig(), (torch.randn(2, 8),), method=method)
    assert ("use_cache", "False") in gm.meta["pdcompile.constants"]
    assert gm(torch.randn(3, 8)).shape == (3, 8)
