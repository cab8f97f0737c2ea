"""Capture through torch.export: Hugging Face models, dynamic batch, the known traps."""

from __future__ import annotations

import sys

import pytest
import torch
from support import captured, example, flat, fresh_like

import pdcompile
from pdcompile import zoo
from pdcompile.core.ir import CAPTURE, CONSTANTS, INPUTS, param_table

HF_MODELS = sorted(zoo.HF_ZOO)


@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_model_captures_by_export_and_matches_on_fresh_inputs(name: str) -> None:
    model, gm, bound, _ = captured(name)
    assert gm.meta[CAPTURE] == "export"
    assert dict(gm.meta[CONSTANTS])["use_cache"] == "False"
    for batch in (1, 3, 6):  # one graph for every microbatch size
        fresh = fresh_like(bound.tensors, batch, seed=batch)
        args, kwargs = bound.call(fresh)
        with torch.no_grad():
            expected, actual = model(*args, **kwargs), gm(**fresh)
        assert type(actual) is type(expected)  # the ModelOutput structure is restored
        for a, e in zip(flat(actual), flat(expected), strict=True):
            torch.testing.assert_close(a, e)


def test_hf_fx_path_alone_fails_clearly() -> None:
    model, args, kwargs = example("hf_gpt2", eval_mode=True)
    with pytest.raises(pdcompile.TraceError, match="GPT2LMHeadModel"):
        pdcompile.trace(model, args, example_kwargs=kwargs, method="fx", auto_leaf=False)


def test_exported_tied_parameters_keep_every_original_name() -> None:
    model, gm, _, _ = captured("hf_gpt2")
    assert set(gm.state_dict()) == set(model.state_dict())
    tied = [p for p in param_table(gm).values() if len(p.names) > 1]
    assert len(tied) == 1
    assert set(tied[0].names) == {"transformer.wte.weight", "lm_head.weight"}
    assert len(tied[0].users) == 2  # the embedding lookup and the LM head
    assert gm.get_parameter("lm_head.weight") is model.lm_head.weight


def test_exported_non_persistent_buffers_stay_out_of_the_state_dict() -> None:
    model, gm, _, _ = captured("hf_bert")
    assert set(gm.state_dict()) == set(model.state_dict())


def test_other_sequence_length_is_a_clear_error() -> None:
    _, gm, bound, _ = captured("hf_llama")
    longer = {k: torch.cat([v, v], dim=1) for k, v in bound.tensors.items()}
    with pytest.raises(pdcompile.TraceError, match="only the batch dimension is dynamic"):
        gm(**longer)
    with pytest.raises(pdcompile.TraceError, match="dtype"):
        gm(**{k: v.float() for k, v in bound.tensors.items()})


def test_exported_graph_refuses_to_switch_mode() -> None:
    _, gm, _, _ = captured("hf_gpt2")
    gm.eval()  # the captured mode: allowed
    with pytest.raises(pdcompile.TraceError, match="captured in eval mode"):
        gm.train()


def test_export_of_a_one_row_example_keeps_the_batch_dynamic() -> None:
    model, args, kwargs = example("gpt", eval_mode=True)
    one = args[0][:1]
    gm = pdcompile.trace(model, (one,), method="export")
    assert gm.meta[CAPTURE] == "export" and gm.meta[INPUTS] == ("idx",)
    for batch in (1, 5):
        x = fresh_like({"idx": one}, batch, seed=batch)["idx"]
        torch.testing.assert_close(gm(x), model(x))
    assert set(gm.state_dict()) == set(model.state_dict())


def test_forced_export_matches_fx_for_zoo_models() -> None:
    for name in ("resnet", "kwargs_model", "unet"):
        model, args, kwargs = example(name, eval_mode=True)
        gm = pdcompile.trace(model, args, example_kwargs=kwargs, method="export")
        assert gm.meta[CAPTURE] == "export"
        fresh = fresh_like(pdcompile.capture.inputs.bind_inputs(model, args, kwargs).tensors, 3)
        with torch.no_grad():
            for a, e in zip(flat(gm(**fresh)), flat(model(**fresh)), strict=True):
                torch.testing.assert_close(a, e)


def test_export_that_fixes_the_batch_size_names_the_fix() -> None:
    class FixedBatch(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.reshape(4, -1)

    with pytest.raises(pdcompile.TraceError, match="fixes the batch size"):
        pdcompile.trace(FixedBatch(), (torch.randn(4, 3),), method="export")


class _BranchesOnAValue(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("the model's own line", file=sys.stderr)
        h = self.a(x)
        return h * 2 if (h > 0).any().item() else h


def test_a_failed_export_keeps_its_partial_graph_off_the_terminal(capsys) -> None:
    """torch.export printed the partial graph of a failed export to stderr (twice per try),
    above the TraceError; it stays on the cause, and the model's own output still shows."""
    with pytest.raises(pdcompile.TraceError, match="data-dependent") as caught:
        pdcompile.trace(_BranchesOnAValue(), (torch.randn(8, 4),), method="export")
    err = capsys.readouterr().err
    assert "def forward(self" not in err and "the model's own line" in err
    assert "def forward(self" in caught.value.__cause__.partial_fx_graph
