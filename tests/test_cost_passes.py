"""The cost passes (memory, analytic, profile), analyze() and the CostGraph they produce."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
from support import captured, example

import pdcompile
from pdcompile.compiling.analysis import graph_inputs
from pdcompile.core.ir import (
    ACTIVATION_BYTES,
    ANALYTIC_S,
    FLOPS,
    GRAD_BYTES,
    MEASURED_S,
    OPTIMIZER_BYTES,
    PARAM_BYTES,
    PROFILE,
)
from pdcompile.passes import profile as profile_pass
from pdcompile.passes.analytic import annotate_analytic
from pdcompile.passes.device_model import PRESETS, DeviceModel
from pdcompile.passes.memory import annotate_memory
from pdcompile.passes.profile import annotate_profile


def fresh(name: str):
    """A newly captured zoo graph (these passes write node.meta) with its graph inputs."""
    model, args, kwargs = example(name)
    gm = pdcompile.trace(model, args, example_kwargs=kwargs)
    return model, gm, graph_inputs(gm, args, kwargs)


def saved_bytes_of(model: nn.Module, args: tuple) -> int:
    """Reference: bytes of every distinct storage autograd saves in one eager forward."""
    state = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.random.fork_rng(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args)
    return sum(n for key, n in saved.items() if key not in state)


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet", "inception"])
def test_activation_bytes_sum_to_what_autograd_saves(name: str) -> None:
    model, gm, inputs = fresh(name)
    annotate_memory(gm, inputs, "sgd")
    total = sum(n.meta[ACTIVATION_BYTES] for n in gm.graph.nodes)
    assert total == saved_bytes_of(model, tuple(inputs.values())) > 0


@pytest.mark.parametrize(("optimizer", "copies"), [("sgd", 0), ("momentum", 1), ("adam", 2)])
def test_parameter_gradient_and_optimizer_bytes(optimizer: str, copies: int) -> None:
    model, gm, inputs = fresh("gpt")
    annotate_memory(gm, inputs, optimizer)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())  # the tied weight counts once
    assert sum(n.meta[PARAM_BYTES] for n in gm.graph.nodes) == param_bytes
    assert sum(n.meta[GRAD_BYTES] for n in gm.graph.nodes) == param_bytes
    steps = 4 * len(list(model.parameters())) if optimizer == "adam" else 0  # a step count each
    assert sum(n.meta[OPTIMIZER_BYTES] for n in gm.graph.nodes) == copies * param_bytes + steps
    nodes = {n.name: n for n in gm.graph.nodes}
    assert (
        nodes["wte"].meta[PARAM_BYTES] == 128 * 64 * 4 and nodes["lm_head"].meta[PARAM_BYTES] == 0
    )


def test_an_example_that_views_a_larger_tensor_charges_its_own_bytes() -> None:
    """`x[:4]` of a dataset saves a view whose storage is the whole dataset: the input and the
    targets are charged at their own bytes, as the same rows copied out (found on main: stage
    0 of an MLP charged 4 MiB per microbatch for 64 KiB of input)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    data, labels = torch.randn(1000, 8), torch.randn(1000, 8)
    charged = []
    for x, y in ((data[:4], labels[:4]), (data[:4].clone(), labels[:4].clone())):
        gm = pdcompile.trace(model, (x,))
        annotate_memory(gm, graph_inputs(gm, (x,), None), "sgd", nn.functional.mse_loss, y)
        charged.append([n.meta[ACTIVATION_BYTES] for n in gm.graph.nodes])
    assert charged[0] == charged[1]
    assert sum(charged[0]) < data.nbytes


def test_unknown_optimizer_is_a_cost_error() -> None:
    _, gm, inputs = fresh("mlp")
    with pytest.raises(pdcompile.CostError, match="optimizer must be one of"):
        annotate_memory(gm, inputs, "lamb")


def test_linear_flops_and_roofline_time() -> None:
    _, gm, inputs = fresh("mlp")
    annotate_analytic(gm, inputs, "cpu")
    first = next(n for n in gm.graph.nodes if n.op == "call_module")  # Linear(32, 64), batch 4
    forward, backward = first.meta[FLOPS]
    assert forward == 2 * 4 * 32 * 64
    assert backward == 2 * 4 * 32 * 64  # weight gradient only: the input needs no gradient
    cpu = PRESETS["cpu"]
    moved = (4 * 32 + 64 * 32 + 64 + 4 * 64) * 4
    assert first.meta[ANALYTIC_S][0] == pytest.approx(cpu.time(forward, moved))
    hidden = [n for n in gm.graph.nodes if n.op == "call_module"][3]  # Linear(64, 64)
    assert hidden.meta[FLOPS] == (2 * 4 * 64 * 64, 2 * 2 * 4 * 64 * 64)  # + input gradient


def test_device_model_roofline_and_presets() -> None:
    model = DeviceModel(peak_flops=1e12, memory_bandwidth=1e11, overhead_s=1e-6)
    assert model.time(1e12, 0) == pytest.approx(1.0 + 1e-6)
    assert model.time(0, 1e11) == pytest.approx(1.0 + 1e-6)
    assert set(PRESETS) >= {"cpu", "a100", "h100"}
    assert DeviceModel.get("H100") is PRESETS["h100"]
    with pytest.raises(pdcompile.CostError, match="presets: cpu, a100, h100"):
        DeviceModel.get("tpu")
    with pytest.raises(pdcompile.CostError, match="peak_flops > 0"):
        DeviceModel(0, 1)


def test_analytic_costs_on_the_meta_device() -> None:
    with torch.device("meta"):
        cfg = pdcompile.zoo.GPTConfig(n_layer=2, n_embd=256, vocab_size=1000, block_size=128)
        model = pdcompile.zoo.GPT(cfg)
        idx = torch.zeros(2, 128, dtype=torch.long)
    gm = pdcompile.trace(model, (idx,))
    costs = pdcompile.analyze(gm, (idx,), profile=False, device_model="h100")
    assert costs.meta["source"] == "analytic" and costs.meta["device_model"] == "h100"
    head = costs.graph.nodes["lm_head"]
    assert head["flops_forward"] == 2 * 2 * 128 * 256 * 1000
    assert head["forward_s"] > 0 and head["activation_bytes"] == 2 * 128 * 256 * 4
    with pytest.raises(pdcompile.CostError, match="meta device cannot be profiled"):
        pdcompile.analyze(gm, (idx,))


def test_profile_times_every_compute_node_and_caches(tmp_path, monkeypatch) -> None:
    # this tests caching, not settling: a loaded machine may scatter repeats, and an unsettled
    # profile is (rightly) not cached; tests/test_profile_cache.py covers settling
    monkeypatch.setattr(profile_pass, "MAX_SLOWDOWN", math.inf)
    _, gm, inputs = fresh("gpt")
    annotate_profile(gm, inputs, warmup=1, repeats=3, cache=tmp_path, progress=False)
    first = {n.name: n.meta[MEASURED_S] for n in gm.graph.nodes}
    assert gm.meta[PROFILE].cached is False and gm.meta[PROFILE].num_threads == 1
    compute = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function")]
    assert all(n.meta[MEASURED_S][0] > 0 for n in compute)
    linears = [
        n for n in compute
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear)
    ]  # fmt: skip
    assert len(linears) == 17 and all(n.meta[MEASURED_S][1] > 0 for n in linears)
    assert first["idx"] == (0.0, 0.0) and first["size"][1] == 0.0  # an int has no backward
    (cache_file,) = tmp_path.glob("profile-*.json")

    def no_measuring(*args, **kwargs):
        raise AssertionError("a cached profile was measured again")

    with monkeypatch.context() as patch:
        patch.setattr(profile_pass, "_measure", no_measuring)
        annotate_profile(gm, inputs, warmup=1, repeats=3, cache=tmp_path, progress=False)
    assert gm.meta[PROFILE].cached is True
    assert {n.name: n.meta[MEASURED_S] for n in gm.graph.nodes} == first

    annotate_profile(gm, inputs, num_threads=2, warmup=1, repeats=3, cache=tmp_path, progress=False)
    assert gm.meta[PROFILE].cached is False and len(list(tmp_path.glob("profile-*.json"))) == 2

    cache_file.write_text('{"key": "tr')  # a truncated cache file is ignored, then rewritten
    annotate_profile(gm, inputs, warmup=1, repeats=3, cache=tmp_path, progress=False)
    assert gm.meta[PROFILE].cached is False and json.loads(cache_file.read_text())["nodes"]


def test_profile_leaves_model_state_and_gradients_alone(tmp_path) -> None:
    model, gm, inputs = fresh("resnet")
    model(*inputs.values()).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    annotate_profile(gm, inputs, warmup=1, repeats=2, cache=False, progress=False)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_inplace_nodes_are_profiled_without_corrupting_values() -> None:
    class Inplace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(256, 256)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.act(self.fc(x))
            y += 1
            return y.sigmoid_()

    # big enough that the ReLU's backward stands clear of the autograd call overhead subtracted
    x = torch.randn(2048, 256)
    gm = pdcompile.trace(Inplace(), (x,))
    costs = pdcompile.analyze(gm, (x,), cache=False, progress=False)
    assert costs.graph.nodes["act"]["backward_s"] > 0
    assert costs.graph.nodes["act"]["flops_forward"] == 0


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2"])
def test_analyze_returns_the_cost_graph_of_the_captured_graph(name: str) -> None:
    model, args, kwargs = example(name)
    gm = pdcompile.trace(model, args, example_kwargs=kwargs)
    costs = pdcompile.analyze(gm, args, example_kwargs=kwargs, optimizer="adam", cache=False,
                              progress=False)  # fmt: skip
    assert costs.nodes == [n.name for n in gm.graph.nodes]
    assert costs.batch_size == 4 and costs.meta["capture"] == gm.meta["pdcompile.capture"]
    assert costs.meta["optimizer"] == "adam" and costs.meta["source"] == "profile"
    totals = costs.totals()
    assert totals["param_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    steps = 4 * len(list(model.parameters()))  # Adam's step count, a float32 per tensor
    assert totals["optimizer_bytes"] == 2 * totals["param_bytes"] + steps
    assert totals["forward_s"] > 0 and totals["backward_s"] > 0
    for u, _, data in costs.graph.edges(data=True):
        assert data["bytes"] == costs.graph.nodes[u]["output_bytes"]
    assert [k for k, n in costs.graph.nodes(data=True) if n["kind"] == "input"] == list(
        gm.meta["pdcompile.inputs"]
    )


def test_analyze_coarsens_and_keeps_totals() -> None:
    model, gm, bound, _ = captured("gpt")
    full = pdcompile.analyze(gm, tuple(bound.tensors.values()), profile=False)
    layers = pdcompile.analyze(gm, tuple(bound.tensors.values()), profile=False, coarsen=8)
    assert len(layers.nodes) <= 8
    for key, value in full.totals().items():
        assert math.isclose(layers.totals()[key], value, rel_tol=1e-12), key
    members = [m for n in layers.nodes for m in layers.graph.nodes[n]["members"]]
    assert members == full.nodes


def test_analyze_errors_name_the_problem() -> None:
    _, gm, _, _ = captured("kwargs_model")
    with pytest.raises(
        pdcompile.CostError, match=r"no example tensor for graph input\(s\) \['context'\]"
    ):
        pdcompile.analyze(gm, (torch.randn(4, 32),), profile=False)


def test_profiling_on_another_device_leaves_the_model_where_it_is() -> None:
    model, gm, bound, _ = captured("mlp")
    costs = pdcompile.analyze(gm, tuple(bound.tensors.values()), profile=False, device="meta")
    assert costs.meta["device"] == "meta"
    assert all(p.device.type == "cpu" for p in [*model.parameters(), *gm.parameters()])
