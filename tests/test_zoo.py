"""Tests for the model zoo: factory contract, determinism, gradients and fx traceability."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

from pdcompile import zoo

HF_NAMES = sorted(zoo.HF_ZOO)
ALL_NAMES = sorted(zoo.ZOO) + HF_NAMES


def _build(name: str) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    if name in zoo.HF_ZOO:
        pytest.importorskip("transformers")
    out = getattr(zoo, name)()
    assert isinstance(out, tuple) and len(out) in (2, 3)
    model, args = out[0], out[1]
    kwargs = out[2] if len(out) == 3 else {}
    return model, args, kwargs


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Flatten tensors out of a (possibly nested) model output."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return list(args) + [kwargs[k] for k in sorted(kwargs)]


def test_registry_matches_all() -> None:
    assert set(zoo.ZOO) == {
        "mlp", "resnet", "gpt", "transformer_encoder", "kwargs_model",
        "data_dependent", "inception", "unet",
    }  # fmt: skip
    assert set(zoo.HF_ZOO) == {"hf_gpt2", "hf_bert", "hf_llama"}
    for name, fn in {**zoo.ZOO, **zoo.HF_ZOO}.items():
        assert name in zoo.__all__ and getattr(zoo, name) is fn
    assert "ZOO" in zoo.__all__ and "HF_ZOO" in zoo.__all__


@pytest.mark.parametrize("name", ALL_NAMES)
def test_factory_contract(name: str) -> None:
    model, args, kwargs = _build(name)
    assert isinstance(model, nn.Module) and model.training
    assert isinstance(args, tuple) and all(isinstance(a, torch.Tensor) for a in args)
    assert isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)
    inputs = _inputs(args, kwargs)
    assert inputs and all(t.shape[0] == 4 for t in inputs)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_factory_is_deterministic_and_keeps_rng(name: str) -> None:
    if name in zoo.HF_ZOO:
        pytest.importorskip("transformers")
    before = torch.get_rng_state()
    m1, a1, k1 = _build(name)
    assert torch.equal(torch.get_rng_state(), before)
    m2, a2, k2 = _build(name)
    assert torch.equal(torch.get_rng_state(), before)

    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    for key in s1:
        assert torch.equal(s1[key], s2[key]), key
    assert k1.keys() == k2.keys()
    for t1, t2 in zip(_inputs(a1, k1), _inputs(a2, k2), strict=True):
        assert t1.dtype == t2.dtype and torch.equal(t1, t2)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_forward_backward_reaches_every_parameter(name: str) -> None:
    model, args, kwargs = _build(name)
    outs = [t for t in _tensors(model(*args, **kwargs)) if t.is_floating_point()]
    assert outs
    sum(t.sum() for t in outs).backward()
    missing = {n for n, p in model.named_parameters() if p.grad is None}
    if name == "data_dependent":
        # Only one of the router's two experts runs for a given input.
        a = {"router.a.weight", "router.a.bias"}
        b = {"router.b.weight", "router.b.bias"}
        assert missing in (a, b)
    else:
        assert not missing, missing
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), n


def test_output_shapes() -> None:
    expected = {
        "mlp": [(4, 10)],
        "resnet": [(4, 10)],
        "gpt": [(4, 16, 128)],
        "transformer_encoder": [(4, 10)],
        "kwargs_model": [(4, 10), (4, 32)],
        "data_dependent": [(4, 10)],
        "inception": [(4, 10)],
        "unet": [(4, 4, 32, 32)],
    }
    for name, shapes in expected.items():
        model, args, kwargs = _build(name)
        with torch.no_grad():
            got = [tuple(t.shape) for t in _tensors(model(*args, **kwargs))]
        assert got == shapes, name


def test_gpt_lm_head_is_tied() -> None:
    model, (idx,), _ = _build("gpt")
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.bias is None
    assert idx.dtype == torch.long and idx.shape == (4, 16)
    n_unique = sum(p.numel() for p in model.parameters())
    n_with_dup = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert n_with_dup - n_unique == model.wte.weight.numel()


def test_kwargs_model_dict_output_and_branches() -> None:
    model, (x,), kwargs = _build("kwargs_model")
    assert set(kwargs) == {"context"}
    model.eval()
    out = model(x, **kwargs)
    assert set(out) == {"logits", "features"}
    masked = model(x, context=kwargs["context"], mask=torch.zeros_like(out["features"]))
    assert not torch.allclose(masked["logits"], out["logits"])
    assert torch.allclose(model(x, **kwargs, scale=2.0)["features"], 2 * out["features"])


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_symbolic_trace_matches_eager(name: str) -> None:
    model, args, _ = _build(name)
    gm = torch.fx.symbolic_trace(model)
    model.eval()
    gm.eval()
    with torch.no_grad():
        torch.testing.assert_close(gm(*args), model(*args))


def test_kwargs_model_traces_with_defaults_bound() -> None:
    model, (x,), kwargs = _build("kwargs_model")
    gm = torch.fx.symbolic_trace(model, concrete_args={"mask": None, "scale": 1.0})
    model.eval()
    gm.eval()
    with torch.no_grad():
        got, want = gm(x, kwargs["context"]), model(x, **kwargs)
    assert set(got) == {"logits", "features"}
    for key in want:
        torch.testing.assert_close(got[key], want[key])


class _RouterLeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, zoo.Router) or super().is_leaf_module(m, qualname)


def test_data_dependent_router_is_the_only_untraceable_part() -> None:
    model, (x,), _ = _build("data_dependent")
    assert isinstance(model.get_submodule("router"), zoo.Router)
    routers = [n for n, m in model.named_modules() if isinstance(m, zoo.Router)]
    assert routers == ["router"]

    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model.router)
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)

    graph = _RouterLeafTracer().trace(model)
    gm = torch.fx.GraphModule(model, graph)
    targets = [n.target for n in graph.nodes if n.op == "call_module"]
    assert "router" in targets
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
        torch.testing.assert_close(gm(-x), model(-x))


def test_data_dependent_router_takes_both_branches() -> None:
    model, (x,), _ = _build("data_dependent")
    r = model.router
    pos, neg = torch.ones(4, 32), -torch.ones(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(r(pos), r.a(pos))
        torch.testing.assert_close(r(neg), r.b(neg))


def test_hf_factories_explain_missing_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    for fn in zoo.HF_ZOO.values():
        with pytest.raises(ImportError, match=r"pdcompile\[hf\]"):
            fn()
