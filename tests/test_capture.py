"""Capture: both paths, leaf policy, auto-leaf, constants, equality with the original model."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import captured, example, flat, fresh_like

import pdcompile
from pdcompile import zoo
from pdcompile.core.ir import AUTO_LEAVES, CAPTURE, CONSTANTS, INPUTS, TRAINING, module_path

FX_MODELS = sorted(zoo.ZOO)


@pytest.mark.parametrize("name", FX_MODELS)
def test_zoo_model_captures_by_fx_and_matches_on_fresh_inputs(name: str) -> None:
    model, gm, bound, _ = captured(name)
    assert gm.meta[CAPTURE] == "fx"
    assert gm.meta[TRAINING] is False
    gm.graph.lint()
    for batch in (bound.batch_size, 3):
        fresh = fresh_like(bound.tensors, batch)
        args, kwargs = bound.call(fresh)
        with torch.no_grad():
            expected, actual = flat(model(*args, **kwargs)), flat(gm(**fresh))
        assert len(actual) == len(expected) > 0
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e)


@pytest.mark.parametrize("name", ["gpt", "resnet", "unet"])
def test_train_mode_graph_matches_outputs_and_gradients(name: str) -> None:
    """Dropout and BatchNorm in train mode: same RNG stream, same outputs and gradients."""
    model, gm, bound, _ = captured(name, eval_mode=False)
    assert gm.meta[TRAINING] is True
    fresh = fresh_like(bound.tensors, 3)
    args, kwargs = bound.call(fresh)
    results = []
    for module, call in ((model, lambda: model(*args, **kwargs)), (gm, lambda: gm(**fresh))):
        module.zero_grad()
        torch.manual_seed(5)
        out = flat(call())
        sum(o.float().square().mean() for o in out).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((out, grads))
    (out_a, grads_a), (out_b, grads_b) = results
    for a, b in zip(out_a, out_b, strict=True):
        torch.testing.assert_close(a, b)
    assert grads_a.keys() == grads_b.keys()
    for key in grads_a:
        torch.testing.assert_close(grads_a[key], grads_b[key], msg=key)


def test_capture_leaves_the_model_state_and_rng_alone() -> None:
    model, args, kwargs = example("resnet")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    pdcompile.trace(model, args)
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_transformer_encoder_comes_out_split_by_layer() -> None:
    model, gm, _, _ = captured("transformer_encoder")
    modules = {module_path(n) for n in gm.graph.nodes}
    for i in range(len(model.encoder.layers)):
        layer = f"encoder.layers.{i}"
        assert f"{layer}.self_attn" in modules
        assert f"{layer}.linear1" in modules and f"{layer}.norm2" in modules
    assert not any(n.op == "call_module" and n.target.startswith("encoder.layers.")
                   and n.target.count(".") == 2 for n in gm.graph.nodes)  # fmt: skip


def test_transformer_encoder_with_padding_mask_matches() -> None:
    model, args, _ = example("transformer_encoder", eval_mode=True)
    mask = torch.zeros(args[0].shape, dtype=torch.bool)
    mask[:, -3:] = True
    gm = pdcompile.trace(model, args, example_kwargs={"src_key_padding_mask": mask})
    assert gm.meta[INPUTS] == ("tokens", "src_key_padding_mask")
    with (
        torch.enable_grad()
    ):  # the eager fast path (no grad) zeroes padded rows; compare slow paths
        torch.testing.assert_close(gm(args[0], mask), model(args[0], src_key_padding_mask=mask))


def test_primitive_layers_are_leaves_and_composites_are_traced_through() -> None:
    model, gm, _, _ = captured("gpt")
    leaves = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    for target in leaves:
        module = gm.get_submodule(target)
        assert pdcompile.capture.leaf_policy.is_primitive(module), target
    assert "h.0.attn.c_attn" in leaves and "lm_head" in leaves
    assert not any(isinstance(gm.get_submodule(t), (zoo.Block, nn.Sequential)) for t in leaves)


@pytest.mark.parametrize("leaf", [zoo.Block, "h.1"])
def test_user_leaf_modules_by_type_and_by_name(leaf) -> None:
    model, args, _ = example("gpt", eval_mode=True)
    gm = pdcompile.trace(model, args, leaf_modules=[leaf])
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    expected = [f"h.{i}" for i in range(4)] if leaf is zoo.Block else ["h.1"]
    assert [c for c in calls if c.startswith("h.") and c.count(".") == 1] == expected
    torch.testing.assert_close(gm(*args), model(*args))


def test_unknown_leaf_name_is_a_clear_error() -> None:
    model, args, _ = example("gpt")
    with pytest.raises(pdcompile.TraceError, match=r"'h\.9'.*not a submodule.*did you mean"):
        pdcompile.trace(model, args, leaf_modules=["h.9"])
    with pytest.raises(pdcompile.TraceError, match="classes or qualified names"):
        pdcompile.trace(model, args, leaf_modules=[3])


def test_data_dependent_submodule_becomes_exactly_one_auto_leaf() -> None:
    model, gm, bound, caught = captured("data_dependent")
    assert gm.meta[CAPTURE] == "fx"
    assert [name for name, _ in gm.meta[AUTO_LEAVES]] == ["router"]
    reason = dict(gm.meta[AUTO_LEAVES])["router"]
    assert "control flow" in reason and "zoo.py" in reason and "x.mean() > 0" in reason
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"].count("router") == 1
    assert len(caught) == 1 and "router" in str(caught[0].message)
    for seed in range(4):  # both branches of the router
        x = fresh_like(bound.tensors, 4, seed=seed)["x"] + (seed - 2)
        torch.testing.assert_close(gm(x), model(x))


def test_without_auto_leaf_the_error_names_module_and_line() -> None:
    model, args, _ = example("data_dependent")
    with pytest.raises(pdcompile.TraceError, match=r"'router'.*x\.mean\(\) > 0.*auto_leaf=True"):
        pdcompile.trace(model, args, method="fx", auto_leaf=False)


def test_optional_arguments_not_passed_are_bound_as_constants() -> None:
    model, gm, bound, _ = captured("kwargs_model")
    assert gm.meta[INPUTS] == ("x", "context")
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["x", "context"]
    out = gm(**bound.tensors)
    assert isinstance(out, dict) and set(out) == {"logits", "features"}
    model2, args, kwargs = example("kwargs_model", eval_mode=True)
    gm2 = pdcompile.trace(model2, args, example_kwargs={**kwargs, "scale": 3.0})
    assert dict(gm2.meta[CONSTANTS]) == {"scale": "3.0"}
    with torch.no_grad():
        torch.testing.assert_close(gm2(*args, **kwargs), model2(*args, scale=3.0, **kwargs))


class _TopLevelBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent at the top level: neither path can follow it
            return self.fc(x)
        return -x


def test_no_capture_path_gives_one_error_with_both_reasons() -> None:
    with pytest.raises(pdcompile.TraceError) as info:
        pdcompile.trace(_TopLevelBranch(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "no path could capture _TopLevelBranch" in message
    assert "fx:" in message and "export:" in message and "x.sum() > 0" in message
    assert "Remedies" in message


class _Looping(nn.Module):
    """Loops over a size fx cannot read; torch.export follows it."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(x.size(1) // 8):
            x = x + self.big(x) * i
        return x


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Looping()
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_auto_falls_back_to_export_when_one_auto_leaf_holds_most_parameters() -> None:
    model = _Wrapper().eval()
    x = torch.randn(3, 16)
    gm = pdcompile.trace(model, (x,))
    assert gm.meta[CAPTURE] == "export"
    with pytest.warns(pdcompile.TraceWarning, match="inner: TypeError"):
        forced = pdcompile.trace(model, (x,), method="fx")
    assert forced.meta[CAPTURE] == "fx" and dict(forced.meta[AUTO_LEAVES]).keys() == {"inner"}
    torch.testing.assert_close(gm(x), model(x))


class _Lies(nn.Module):
    """Reads a global flag at trace time: the graph cannot record the other branch."""

    flip = False

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Lies.flip = not _Lies.flip
        return self.fc(x) if _Lies.flip else -self.fc(x)


def test_a_graph_that_computes_something_else_is_refused() -> None:
    with pytest.raises(pdcompile.TraceError, match="differs from _Lies"):
        pdcompile.trace(_Lies(), (torch.randn(2, 4),), method="fx")


def test_bad_example_inputs_are_clear_errors() -> None:
    model, args, _ = example("mlp")
    with pytest.raises(pdcompile.TraceError, match="do not fit"):
        pdcompile.trace(model, (args[0], args[0]))
    with pytest.raises(pdcompile.TraceError, match="tuple of the model's positional arguments"):
        pdcompile.trace(model, {"x": args[0]})
    with pytest.raises(pdcompile.TraceError, match="method must be one of"):
        pdcompile.trace(model, args, method="jit")

    class TakesList(nn.Module):
        def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
            return xs[0] + xs[1]

    with pytest.raises(pdcompile.TraceError, match="holding tensors.*separate"):
        pdcompile.trace(TakesList(), ([args[0], args[0]],))


class _SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(F.relu(self.bn(self.conv(x)))).flatten(1)


def test_meta_device_models_capture_without_data() -> None:
    with torch.device("meta"):
        model = _SmallCNN()
        x = torch.empty(2, 3, 8, 8)
    for method in ("fx", "export"):
        gm = pdcompile.trace(model, (x,), method=method)
        out = [n for n in gm.graph.nodes if n.op == "output"][0]
        assert out.meta["pdcompile.outputs"][0].shape == (2, 256), method


def test_warning_free_capture_of_traceable_models() -> None:
    model, args, _ = example("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("error", pdcompile.TraceWarning)
        pdcompile.trace(model, args)


def test_fx_graph_refuses_to_switch_mode_and_leaves_the_model_mode_alone() -> None:
    model, gm, _, _ = captured("gpt", eval_mode=False)
    with pytest.raises(pdcompile.TraceError, match="captured in train mode.*model.eval"):
        gm.eval()
    assert gm.training and model.training and model.drop.training


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]


class _Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> _Out:
        h = self.fc(x)
        return _Out(h * 2, (h, [h + y]) if y is not None else (h,))


@pytest.mark.parametrize("method", ["fx", "export"])
def test_dataclass_and_nested_outputs_keep_their_structure(method: str) -> None:
    model = _Structured()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    gm = pdcompile.trace(model, (x,), example_kwargs={"y": y}, method=method)
    x3, y3 = torch.randn(3, 4), torch.randn(3, 4)
    out, expected = gm(x3, y3), model(x3, y=y3)
    assert isinstance(out, _Out) and isinstance(out.hidden[1], list)
    for a, e in zip(flat(out), flat(expected), strict=True):
        torch.testing.assert_close(a, e)
