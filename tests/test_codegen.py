"""Code generation: stage programs equal the original model, under solver plans and random cuts."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from support import captured, flat, fresh_like

import pdcompile
from pdcompile import Cluster, Plan, Stage, StagedProgram, zoo
from pdcompile.lowering.staged_program import Channel, TieGroup, batch_dim

MODELS = sorted(zoo.ZOO) + sorted(zoo.HF_ZOO)
_COSTS: dict[str, pdcompile.CostGraph] = {}


def plan_of(groups: Sequence[Sequence[str]]) -> Plan:
    """A plan with one replica per stage, from node names per stage."""
    stages = tuple(
        Stage(index=i, nodes=tuple(nodes), replicas=1, ranks=(i,)) for i, nodes in enumerate(groups)
    )
    return Plan(stages=stages, cluster=Cluster.parse(str(len(groups))))


def pieces(gm, count: int) -> list[list[str]]:
    """The graph's node order cut into `count` pieces of nearly equal length."""
    names = [n.name for n in gm.graph.nodes]
    bounds = [round(i * len(names) / count) for i in range(count + 1)]
    return [names[bounds[i] : bounds[i + 1]] for i in range(count)]


def costs(name: str) -> pdcompile.CostGraph:
    if name not in _COSTS:
        _, gm, bound, _ = captured(name)
        args, kwargs = bound.call(bound.tensors)
        _COSTS[name] = pdcompile.analyze(
            gm, args, example_kwargs=kwargs, profile=False, device_model="cpu"
        )
    return _COSTS[name]


def loss(output) -> torch.Tensor:
    return sum(t.float().square().mean() for t in flat(output) if t.is_floating_point())


def stage_grad(program: StagedProgram, names: Sequence[str]) -> torch.Tensor | None:
    """The gradient of one original tensor: summed over the stages holding it (tied copies)."""
    grads = []
    for stage in program.stages:
        held = dict(stage.named_parameters(remove_duplicate=False))
        tensors = {id(held[n]): held[n] for n in names if n in held}
        grads += [t.grad for t in tensors.values() if t.grad is not None]
    return torch.stack(grads).sum(0) if grads else None


def assert_equivalent(name: str, program: StagedProgram, batch: int = 3) -> None:
    """Same outputs and, after a backward pass, the same gradient for every parameter."""
    model, gm, bound, _ = captured(name)
    inputs = fresh_like(bound.tensors, batch)
    args, kwargs = bound.call(inputs)
    model.zero_grad(set_to_none=True)
    expected = model(*args, **kwargs)
    loss(expected).backward()
    groups: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(pname)
    reference = {id(p): p.grad for p in model.parameters()}
    model.zero_grad(set_to_none=True)
    for stage in program.stages:
        stage.zero_grad(set_to_none=True)

    actual = program(**inputs)
    assert type(actual) is type(expected)
    assert len(flat(actual)) == len(flat(expected)) > 0
    for a, e in zip(flat(actual), flat(expected), strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype
        assert torch.allclose(a, e)
    loss(actual).backward()
    for key, names in groups.items():
        ours = stage_grad(program, names)
        if reference[key] is None:
            assert ours is None, names
        else:
            assert ours is not None and torch.allclose(ours, reference[key]), names
    model.zero_grad(set_to_none=True)


def assert_channels_are_direct(gm, program: StagedProgram) -> None:
    """Each value goes from the stage computing it straight to each stage using it, once."""
    inputs = {p.name for p in gm.graph.find_nodes(op="placeholder")}
    seen = set()
    for channel in program.channels:
        src, dst = channel.src_stage, channel.dst_stage
        assert src < dst and (dst, channel.name) not in seen
        seen.add((dst, channel.name))
        made = program.signatures[src].nodes
        assert channel.name in made or (src == 0 and channel.name in inputs)
        assert channel.name in program.signatures[dst].inputs
    for sig in program.signatures[1:]:
        assert set(sig.inputs) == {c.name for c in program.channels_to(sig.index)}


@pytest.mark.parametrize("solver", ["dp", "uniform", "params"])
@pytest.mark.parametrize("name", MODELS)
def test_solver_plans_compute_what_the_model_computes(name: str, solver: str) -> None:
    _, gm, _, _ = captured(name)
    plan = pdcompile.plan(costs(name), Cluster.parse("4"), solver=solver)
    program = pdcompile.codegen(gm, plan)
    assert program.num_stages == plan.num_stages
    assert_channels_are_direct(gm, program)
    assert_equivalent(name, program)


def random_partition(gm, rng: random.Random, count: int) -> list[list[str]]:
    """A random topological order of the graph cut into `count` random contiguous pieces."""
    waiting = {n: len(n.all_input_nodes) for n in gm.graph.nodes}
    ready = [n for n, k in waiting.items() if k == 0]
    order = []
    while ready:
        node = ready.pop(rng.randrange(len(ready)))
        order.append(node.name)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                ready.append(user)
    cuts = sorted(rng.sample(range(1, len(order)), count - 1))
    bounds = [0, *cuts, len(order)]
    return [order[bounds[i] : bounds[i + 1]] for i in range(count)]


@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=10, deadline=None)
@given(rng=st.randoms(use_true_random=False), count=st.integers(2, 8))
def test_random_convex_partitions_compute_what_the_model_computes(
    name: str, rng: random.Random, count: int
) -> None:
    _, gm, _, _ = captured(name)
    program = pdcompile.codegen(gm, plan_of(random_partition(gm, rng, count)))
    assert program.num_stages == count
    assert_channels_are_direct(gm, program)
    assert_equivalent(name, program)


def test_gpt_tie_group_one_owner_copies_elsewhere_one_tensor_per_stage() -> None:
    model, gm, _, _ = captured("gpt")
    program = pdcompile.codegen(gm, plan_of(pieces(gm, 4)))
    assert program.ties == (TieGroup(("wte.weight", "lm_head.weight"), 0, (0, 3)),)
    first, last = program.stages[0], program.stages[3]
    assert first.get_parameter("wte.weight") is model.wte.weight  # the owner shares the model's
    assert first.get_submodule("h.0.ln_1") is model.h[0].ln_1  # leaves under their own names
    copy = last.get_parameter("lm_head.weight")
    assert copy is not model.wte.weight and torch.equal(copy, model.wte.weight)
    assert last.get_parameter("wte.weight") is copy  # one tensor under both names
    assert last.lm_head is not model.lm_head and last.lm_head.weight is copy
    assert_equivalent("gpt", program)


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2", "hf_bert", "resnet"])
def test_state_dicts_together_are_the_models_and_each_loads_its_slice(name: str) -> None:
    model, gm, _, _ = captured(name)
    program = pdcompile.codegen(gm, plan_of(pieces(gm, 3)))
    original = model.state_dict()
    union: dict[str, torch.Tensor] = {}
    for stage in program.stages:
        union.update(stage.state_dict())
    assert set(union) == set(original)
    for key, value in union.items():
        assert torch.equal(value, original[key]), key
    for index, stage in enumerate(program.stages):
        changed = {k: original[k] + 1 if original[k].is_floating_point() else original[k]
                   for k in stage.state_dict()}  # fmt: skip
        stage.load_state_dict(changed)  # strict: the slice has exactly the stage's keys
        for key, value in stage.state_dict().items():
            assert torch.equal(value, changed[key]), (index, key)
    model.load_state_dict(original)  # the stages share the model's tensors: undo the change
    for stage in program.stages:
        stage.load_state_dict({k: original[k] for k in stage.state_dict()})


def test_unet_skip_goes_straight_to_its_stage_with_a_symbolic_batch() -> None:
    _, gm, _, _ = captured("unet")
    program = pdcompile.codegen(gm, plan_of(pieces(gm, 4)))
    skips = [c for c in program.channels if c.src_stage == 0 and c.dst_stage == 3]
    assert skips, "the outermost skip spans the whole network"
    assert skips[0].shape == ("batch", 8, 32, 32) and skips[0].dtype == "float32"
    assert skips[0].requires_grad and skips[0].shape_for(5) == (5, 8, 32, 32)
    assert not [c for c in program.channels if c.name == skips[0].name and c.src_stage != 0]
    assert_equivalent("unet", program)


def test_symbolic_sizes_scale_with_the_microbatch() -> None:
    dims = ("batch", batch_dim(16, 0), batch_dim(2, 1), 64)
    assert dims[1:3] == ("16*batch", "2*batch+1")
    assert Channel(0, 1, "x", shape=dims).shape_for(3) == (3, 48, 7, 64)


def test_shapes_and_ints_cross_as_metadata() -> None:
    """gpt's `idx.size(1)` and `idx.device` feed `arange` in the next stage."""
    _, gm, _, _ = captured("gpt")
    names = [n.name for n in gm.graph.nodes]
    cut = names.index("arange")
    program = pdcompile.codegen(gm, plan_of([names[:cut], names[cut:]]))
    values = {c.name: c for c in program.channels if c.kind == "value"}
    assert values["size"].value_type == "int" and values["getattr_1"].value_type == "torch.device"
    assert_equivalent("gpt", program)


def test_tuple_items_are_picked_where_the_tuple_is_made() -> None:
    """A cut between MultiheadAttention (a tuple) and its getitem moves the getitem, not a tuple."""
    _, gm, _, _ = captured("transformer_encoder")
    names = [n.name for n in gm.graph.nodes]
    cut = names.index("encoder_layers_0_self_attn") + 1
    program = pdcompile.codegen(gm, plan_of([names[:cut], names[cut:]]))
    pick = gm.graph.find_nodes(op="call_function", target=__import__("operator").getitem)
    picked = [n.name for n in pick if n.args[0].name == "encoder_layers_0_self_attn"]
    assert picked and picked[0] in program.signatures[0].nodes
    assert {c.name for c in program.channels} >= {picked[0]}
    assert "encoder_layers_0_self_attn" not in {c.name for c in program.channels}
    assert_equivalent("transformer_encoder", program)


class FromWeightShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows = self.fc.weight.shape[0]  # no input reaches it: a constant
        h = self.fc(x)
        y = self.out(h.view(-1, rows))
        return y, {"hidden": h, "input": x}


def test_constants_are_written_into_the_code_and_nested_outputs_come_back() -> None:
    model = FromWeightShape().eval()
    x = torch.randn(4, 8)
    gm = pdcompile.trace(model, (x,))
    names = [n.name for n in gm.graph.nodes]
    cut = names.index("view")
    program = pdcompile.codegen(gm, plan_of([names[:cut], names[cut:]]))
    assert "getitem" not in {c.name for c in program.channels}
    assert "view(-1, 6)" in program.stages[1].code
    assert [c.name for c in program.channels] == ["x", "fc"]  # the input comes from stage 0
    y, rest = program(x)
    expected_y, expected_rest = model(x)
    assert torch.allclose(y, expected_y) and set(rest) == {"hidden", "input"}
    assert torch.equal(rest["input"], x) and torch.allclose(rest["hidden"], expected_rest["hidden"])


def test_keyword_inputs_and_a_single_stage() -> None:
    _, gm, bound, _ = captured("kwargs_model")
    program = pdcompile.codegen(gm, plan_of([[n.name for n in gm.graph.nodes]]))
    assert program.channels == () and program.signatures[0].inputs == ("x", "context")
    assert_equivalent("kwargs_model", program)
    positional = program(*bound.tensors.values())
    assert torch.allclose(positional["logits"], gm(**bound.tensors)["logits"])


def test_program_prints_stages_and_channels() -> None:
    _, gm, _, _ = captured("gpt")
    text = str(pdcompile.codegen(gm, plan_of(pieces(gm, 2))))
    assert text.startswith("StagedProgram of GPT: 2 stages")
    assert "1 tie group(s)" in text and "0 -> 1" in text


class ReturnsItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x * self.scale).relu(), self.scale


def test_a_parameter_returned_as_output_is_read_by_the_last_stage() -> None:
    model = ReturnsItsWeight()
    x = torch.randn(2, 5)
    gm = pdcompile.trace(model, (x,))
    program = pdcompile.codegen(gm, plan_of([["x", "scale", "mul"], ["relu", "output"]]))
    y, scale = program(x)
    assert torch.equal(y, model(x)[0]) and torch.equal(scale, model.scale)
    assert program.stages[1].get_parameter("scale") is scale  # a copy: the owner is stage 0
    assert program.ties == (TieGroup(("scale",), 0, (0, 1)),)


def test_train_mode_program_follows_the_graphs_random_stream() -> None:
    """Dropout on: with stages in graph order the program draws the same masks as the graph."""
    _, gm, bound, _ = captured("gpt", eval_mode=False)
    program = pdcompile.codegen(gm, plan_of(pieces(gm, 4)))
    assert program.training
    torch.manual_seed(3)
    expected = gm(**bound.tensors)
    torch.manual_seed(3)
    assert torch.equal(program(**bound.tensors), expected)
    with pytest.raises(pdcompile.TraceError, match="captured in train mode"):
        program.stages[1].eval()
