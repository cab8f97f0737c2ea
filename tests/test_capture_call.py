"""The captured graph, and every stage program, take the call the model was captured with
(constants included); models no path captures say where and why on the error's first line."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile import zoo


class _Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0, use_cache: bool | None = None):
        h = torch.tanh(self.a(x)) * scale
        return self.b(h) if not use_cache else self.b(h) + 1


def test_graph_and_stage_programs_take_the_captured_constants(tmp_path) -> None:
    torch.manual_seed(0)
    model, x = _Flagged(), torch.randn(8, 6)
    call = {"x": x, "scale": 2.0, "use_cache": False}
    gm = pdcompile.trace(model, (), example_kwargs=call)
    expected = model(**call)
    torch.testing.assert_close(gm(**call), expected)
    torch.testing.assert_close(gm(x, scale=2.0), expected)
    with pytest.raises(pdcompile.TraceError, match=r"captured with scale=2.0.*scale=3.0"):
        gm(x, scale=3.0)

    costs = pdcompile.analyze(gm, (), example_kwargs={"x": x}, profile=False, progress=False)
    program = pdcompile.codegen(gm, pdcompile.plan(costs, "2", solver="uniform"))
    torch.testing.assert_close(program(**call), expected)
    assert program.stages[0](**call).keys() == program.stages[0](x).keys()
    with pytest.raises(pdcompile.TraceError, match="captured with use_cache=False"):
        program(x, use_cache=True)
    program.write_source(tmp_path)
    loaded = pdcompile.StagedProgram.load(tmp_path, model)
    torch.testing.assert_close(loaded(**call), expected)
    with pytest.raises(pdcompile.TraceError, match="captured with use_cache=False"):
        loaded(x, scale=2.0, use_cache=True)

    y = torch.randint(0, 3, (8,))
    pipe = pdcompile.compile(
        model, (), example_kwargs=call, loss_fn=F.cross_entropy, cluster="2", solver="uniform",
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), profile=False,
    )  # fmt: skip
    assert pipe.train_step((), y, kwargs=call) > 0
    with pytest.raises(pdcompile.TraceError, match="captured with scale=2.0"):
        pipe.train_step((), y, kwargs={**call, "scale": 1.0})


def test_hugging_face_graph_takes_use_cache_false_and_refuses_true() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, kwargs = zoo.hf_llama()
        call = {**kwargs, "use_cache": False}
        gm = pdcompile.trace(model, (), example_kwargs=call)
    assert gm.meta["pdcompile.capture"] == "export"
    torch.testing.assert_close(gm(**call).logits, model(**call).logits)
    with pytest.raises(pdcompile.TraceError, match="captured with use_cache=False"):
        gm(**{**call, "use_cache": True})


class _Counts(nn.Module):
    """Builds a Python list from tensor values: neither fx nor torch.export can follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        boxes = [row for row in x.nonzero()]
        return self.fc(x) * len(boxes)


class _Detector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(4, 4)
        self.heads = _Counts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.backbone(x)
        for _ in range(features.size(1) // 4):  # fx cannot loop over a traced size; export can
            features = features * 2
        return self.heads(features)


def test_no_capture_path_names_each_paths_submodule_and_construct_on_the_first_line() -> None:
    with warnings.catch_warnings(), pytest.raises(pdcompile.TraceError) as info:
        warnings.simplefilter("ignore")
        pdcompile.trace(_Detector(), (torch.randn(2, 4),))
    first = str(info.value).splitlines()[0]
    assert first.startswith("no path could capture _Detector: fx: ")
    assert "range(features.size(1) // 4)" in first  # what stopped fx, in the model itself
    assert "export: torch.export of _Detector failed: in submodule 'heads' (_Counts)" in first
    assert "x.nonzero()" in first
    message = str(info.value)
    assert "leaf_modules=" in message and "cut the model before it" in message


class _KeywordBag(nn.Module):
    """Takes its options through `**kwargs`, as GPT-2 takes `return_dict`."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, **kwargs):
        scale = 2.0 if kwargs.get("double") else 1.0
        return {"out": self.fc(x) * scale + kwargs.get("bias", 0)}


def test_export_takes_constants_passed_through_kwargs() -> None:
    torch.manual_seed(0)
    model, x, bias = _KeywordBag(), torch.randn(3, 4), torch.randn(3, 4)
    call = {"double": True, "bias": bias}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = pdcompile.trace(model, (x,), example_kwargs=call, method="export")
    assert "forward" not in vars(model)  # the binding is undone
    torch.testing.assert_close(gm(x, **call)["out"], model(x, **call)["out"])
    with pytest.raises(pdcompile.TraceError, match="captured with double=True"):
        gm(x, bias=bias, double=False)


class _Output(dict):
    """A dict subclass output, like a Hugging Face ModelOutput."""


class _ReturnsOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> _Output:
        return _Output(logits=self.b(torch.relu(self.a(x))))


def test_symbolic_tracing_keeps_dict_subclass_outputs_through_codegen() -> None:
    torch.manual_seed(0)
    model, x = _ReturnsOutput(), torch.randn(6, 4)
    gm = pdcompile.trace(model, (x,))
    assert gm.meta["pdcompile.capture"] == "fx" and type(gm(x)) is _Output
    costs = pdcompile.analyze(gm, (x,), profile=False, progress=False)
    program = pdcompile.codegen(gm, pdcompile.plan(costs, "2", solver="uniform"))
    out = program(x)
    assert type(out) is _Output
    torch.testing.assert_close(out["logits"], model(x)["logits"])
