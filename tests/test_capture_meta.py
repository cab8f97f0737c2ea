"""The capture passes' node.meta: shapes and bytes, module scopes, parameter ownership."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from support import captured, example

import pdcompile
from pdcompile import zoo
from pdcompile.core.ir import OUTPUT_BYTES, OUTPUTS, PARAMS, SCOPE, TensorSpec, param_table

ALL_MODELS = sorted(zoo.ZOO) + sorted(zoo.HF_ZOO)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_every_parameter_and_buffer_is_owned_under_its_original_names(name: str) -> None:
    model, gm, _, _ = captured(name)
    table = param_table(gm)
    names = [n for p in table.values() for n in p.names]
    assert len(names) == len(set(names))
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    expected |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    assert set(names) == expected
    assert set(gm.state_dict()) == set(model.state_dict())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    assert sum(p.nbytes for p in table.values() if not p.is_buffer) == param_bytes
    nodes = {n.name: n for n in gm.graph.nodes}
    for info in table.values():
        if not info.is_buffer and info.requires_grad:
            assert info.users, f"{info.name} has no user"
        for user in info.users:
            assert info.name in nodes[user].meta[PARAMS]


def test_tied_embedding_and_head_are_one_parameter_with_two_users() -> None:
    model, gm, _, _ = captured("gpt")
    assert model.lm_head.weight is model.wte.weight
    tied = [p for p in param_table(gm).values() if len(p.names) > 1]
    assert [set(p.names) for p in tied] == [{"wte.weight", "lm_head.weight"}]
    assert set(tied[0].users) == {"wte", "lm_head"}
    assert tied[0].nbytes == 128 * 64 * 4


def test_get_attr_parameters_belong_to_their_consumers() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))
            self.register_buffer("shift", torch.zeros(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale + self.shift

    gm = pdcompile.trace(Scaled(), (torch.randn(2, 8),))
    owners = {n.name: n.meta[PARAMS] for n in gm.graph.nodes if n.meta[PARAMS]}
    assert owners == {"mul": ("scale",), "add": ("shift",)}
    shift = param_table(gm)["shift"]
    assert shift.is_buffer and not shift.requires_grad and shift.users == ("add",)


def test_output_shapes_dtypes_and_bytes() -> None:
    _, gm, _, _ = captured("gpt")
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["idx"].meta[OUTPUTS] == (TensorSpec((4, 16), "int64", 4 * 16 * 8),)
    assert nodes["wte"].meta[OUTPUTS] == (TensorSpec((4, 16, 64), "float32", 4 * 16 * 64 * 4),)
    assert nodes["output"].meta[OUTPUTS][0].shape == (4, 16, 128)
    for node in gm.graph.nodes:
        assert node.meta[OUTPUT_BYTES] == sum(s.nbytes for s in node.meta[OUTPUTS])
    assert nodes["size"].meta[OUTPUTS] == ()  # an int, not a tensor


def test_nodes_with_several_outputs_record_each_tensor() -> None:
    _, gm, _, _ = captured("kwargs_model")
    output = [n for n in gm.graph.nodes if n.op == "output"][0]
    assert [s.shape for s in output.meta[OUTPUTS]] == [(4, 10), (4, 32)]
    _, gm, _, _ = captured("hf_bert")
    output = [n for n in gm.graph.nodes if n.op == "output"][0]
    assert [s.shape for s in output.meta[OUTPUTS]] == [(4, 16, 64), (4, 64)]


def test_shapes_follow_other_dtypes() -> None:
    model, args, _ = example("mlp", eval_mode=True)
    gm = pdcompile.trace(model.to(torch.bfloat16), (args[0].to(torch.bfloat16),))
    linear = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert linear.meta[OUTPUTS][0].dtype == "bfloat16"
    rows, cols = linear.meta[OUTPUTS][0].shape
    assert linear.meta[OUTPUTS][0].nbytes == rows * cols * 2


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2"])
def test_scopes_name_the_module_path(name: str) -> None:
    _, gm, _, _ = captured(name)
    prefix = "" if name == "gpt" else "transformer."
    scoped = [n for n in gm.graph.nodes if n.meta[SCOPE]]
    assert len(scoped) > len(gm.graph.nodes) // 2
    in_block = [n for n in scoped if n.meta[SCOPE][-1][0].startswith(f"{prefix}h.1")]
    outermost = "transformer" if prefix else "h.1"  # a ModuleList is never called, so no scope
    assert in_block and all(n.meta[SCOPE][0][0] == outermost for n in in_block)
    for node in scoped:
        names = [q for q, _ in node.meta[SCOPE]]
        assert all(b.startswith(a) for a, b in zip(names, names[1:], strict=False)), names
