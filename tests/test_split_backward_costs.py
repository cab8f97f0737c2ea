"""The split backward's costs: input-gradient (I) and weight-gradient (W) parts of every node,
and the activation bytes W keeps, from the passes through the CostGraph to the plan's stages."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import pdcompile
from pdcompile import CostGraph
from pdcompile.compiling.analysis import graph_inputs
from pdcompile.core.errors import CostError
from pdcompile.core.ir import (
    ACTIVATION_BYTES,
    ANALYTIC_S,
    ANALYTIC_SPLIT_S,
    BYTES_MOVED,
    FLOPS,
    MEASURED_S,
    MEASURED_SPLIT_S,
    SPLIT_FLOPS,
    WEIGHT_GRAD_ACTIVATION_BYTES,
)
from pdcompile.passes import profile as profile_pass
from pdcompile.passes.analytic import annotate_analytic
from pdcompile.passes.coarsening import coarsen
from pdcompile.passes.cost_view import to_cost_graph
from pdcompile.passes.device_model import PRESETS
from pdcompile.passes.memory import annotate_memory
from pdcompile.passes.planning.evaluation import rescore
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.stage_sums import kept_for_weights
from pdcompile.passes.profile import annotate_profile
from pdcompile.passes.profile_cache import CACHE_FORMAT

DATA = Path(__file__).parent / "data" / "pipedream"
B, IN, HIDDEN, OUT = 32, 96, 256, 64  # rows, and the widths of the three Linears


class LinearHeavy(nn.Module):
    """fc1 -> gelu -> fc2 -> relu -> fc3, then `x @ w.t()` with a bare parameter (traced as
    `get_attr`, `t`, `matmul`: a weight that is an argument, not a module's parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, OUT)
        self.w = nn.Parameter(torch.randn(OUT, OUT) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc2(nn.functional.gelu(self.fc1(x))))
        return self.fc3(h) @ self.w.t()


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    """The model's graph after the memory, analytic and (quick) profile passes."""
    torch.manual_seed(0)
    x = torch.randn(B, IN)
    gm = pdcompile.trace(LinearHeavy(), (x,))
    inputs = graph_inputs(gm, (x,), None)
    annotate_memory(gm, inputs)
    annotate_analytic(gm, inputs, "cpu")
    cache = tmp_path_factory.mktemp("profiles")
    with pytest.MonkeyPatch.context() as patch:  # one round and cached, however busy the machine
        patch.setattr(profile_pass, "MAX_SLOWDOWN", math.inf)
        annotate_profile(gm, inputs, warmup=1, repeats=5, cache=cache, progress=False)
    return gm, inputs, cache


def nodes_of(gm) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def test_analytic_flops_of_each_part_are_the_hand_counts(analysed) -> None:
    gm, _, _ = analysed
    node = nodes_of(gm)
    # a Linear with an input that needs gradients: dX = dY W and dW = dY^T X, 2*B*in*out each
    assert node["fc2"].meta[SPLIT_FLOPS] == (2 * B * HIDDEN * HIDDEN, 2 * B * HIDDEN * HIDDEN)
    assert node["fc3"].meta[SPLIT_FLOPS] == (2 * B * HIDDEN * OUT, 2 * B * HIDDEN * OUT)
    assert node["fc2"].meta[FLOPS][1] == sum(node["fc2"].meta[SPLIT_FLOPS])
    # the weight reached through `t` is a weight too: matmul's I and W are each 2*B*OUT*OUT
    (matmul,) = [n for n in gm.graph.nodes if n.op == "call_function" and "matmul" in str(n)]
    assert matmul.meta[SPLIT_FLOPS] == (2 * B * OUT * OUT, 2 * B * OUT * OUT)
    # the first Linear's input is data (no gradient): its whole backward is W
    assert node["fc1"].meta[SPLIT_FLOPS] == (0.0, 2 * B * IN * HIDDEN)
    assert node["fc1"].meta[FLOPS][1] == 2 * B * IN * HIDDEN


def test_analytic_seconds_of_each_part_on_the_roofline(analysed) -> None:
    gm, _, _ = analysed
    node, cpu = nodes_of(gm), PRESETS["cpu"]
    moved = node["fc2"].meta[BYTES_MOVED][0]  # each part moves what the forward moves
    flops = 2 * B * HIDDEN * HIDDEN
    assert node["fc2"].meta[ANALYTIC_SPLIT_S] == (cpu.time(flops, moved), cpu.time(flops, moved))
    for name in ("gelu", "relu"):  # no parameters: all of the backward is I
        assert node[name].meta[ANALYTIC_SPLIT_S] == (node[name].meta[ANALYTIC_S][1], 0.0)
    assert node["fc1"].meta[ANALYTIC_SPLIT_S] == (0.0, node["fc1"].meta[ANALYTIC_S][1])
    weights = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "t"]
    assert weights[0].meta[ANALYTIC_SPLIT_S][0] == 0.0  # a parameter's transpose: W only


def test_profiled_parts_are_measured_apart(analysed) -> None:
    gm, _, _ = analysed
    node = nodes_of(gm)
    backward_input_s, backward_weight_s = node["fc2"].meta[MEASURED_SPLIT_S]
    assert backward_input_s > 0 and backward_weight_s > 0  # two 2*B*HIDDEN*HIDDEN matmuls
    for name in ("gelu", "relu"):
        assert node[name].meta[MEASURED_SPLIT_S] == (node[name].meta[MEASURED_S][1], 0.0)
    assert node["fc1"].meta[MEASURED_SPLIT_S] == (0.0, node["fc1"].meta[MEASURED_S][1])
    assert node["x"].meta[MEASURED_SPLIT_S] == (0.0, 0.0)


def test_the_cache_keeps_the_split(analysed, monkeypatch) -> None:
    gm, inputs, cache = analysed
    monkeypatch.setattr(profile_pass, "MAX_SLOWDOWN", math.inf)
    measured = {n.name: n.meta[MEASURED_SPLIT_S] for n in gm.graph.nodes}
    (path,) = cache.glob("profile-*.json")
    doc = json.loads(path.read_text())
    assert doc["format"] == CACHE_FORMAT and all(len(t) == 4 for t in doc["nodes"].values())
    annotate_profile(gm, inputs, warmup=1, repeats=5, cache=cache, progress=False)
    assert gm.meta["pdcompile.profile"].cached
    assert {n.name: n.meta[MEASURED_SPLIT_S] for n in gm.graph.nodes} == measured


def test_bytes_w_keeps_are_what_the_weight_gradients_read(analysed) -> None:
    gm, _, _ = analysed
    node = nodes_of(gm)
    kept = {name: n.meta[WEIGHT_GRAD_ACTIVATION_BYTES] for name, n in node.items()}
    # fc1 saves x for its weight gradient; gelu saves its input, which only I needs; fc2 saves
    # gelu's output for W; relu saves its output, which fc3's W reads (charged to relu, the
    # first to save it); the matmul keeps fc3's output
    assert kept["fc1"] == B * IN * 4 == node["fc1"].meta[ACTIVATION_BYTES]
    assert kept["gelu"] == 0 < node["gelu"].meta[ACTIVATION_BYTES]
    assert kept["fc2"] == kept["relu"] == B * HIDDEN * 4
    assert kept["fc3"] == 0
    assert sum(kept.values()) == B * (IN + 2 * HIDDEN + OUT) * 4
    assert all(kept[n] <= node[n].meta[ACTIVATION_BYTES] for n in node)


def test_the_cost_graph_carries_the_split(analysed) -> None:
    gm, _, _ = analysed
    for measured, times in ((True, MEASURED_SPLIT_S), (False, ANALYTIC_SPLIT_S)):
        g = to_cost_graph(gm, B, {"source": "test"}, measured=measured)
        for n in gm.graph.nodes:
            attrs = g.graph.nodes[n.name]
            assert (attrs["backward_input_s"], attrs["backward_weight_s"]) == n.meta[times]
            assert attrs["weight_grad_activation_bytes"] == n.meta[WEIGHT_GRAD_ACTIVATION_BYTES]
        assert g.graph.nodes["fc2"]["backward_input_s"] > 0
        assert g.graph.nodes["relu"]["backward_weight_s"] == 0.0


def chain() -> CostGraph:
    g = CostGraph(batch_size=8, meta={"source": "test"})
    g.add_node("x", kind="input", output_bytes=64)
    previous = "x"
    for i in range(4):
        g.add_node(
            f"n{i}", forward_s=1e-3 * (i + 1), backward_s=2e-3 * (i + 1),
            backward_input_s=0.75e-3 * (i + 1), backward_weight_s=1.5e-3 * (i + 1),
            param_bytes=1000, grad_bytes=1000, activation_bytes=800 + i,
            weight_grad_activation_bytes=300 + i, output_bytes=64,
        )  # fmt: skip
        g.add_edge(previous, f"n{i}", 64)
        previous = f"n{i}"
    return g


def test_attributes_defaults_and_checks() -> None:
    g = CostGraph(batch_size=4)
    g.add_node("a", backward_s=3e-3, activation_bytes=100)
    g.add_node("b", backward_s=3e-3, backward_input_s=3e-3)  # no parameters: all of it is I
    g.add_node("c", backward_s=3e-3, backward_input_s=1e-3, backward_weight_s=4e-3)
    a, b, c = (g.graph.nodes[n] for n in "abc")
    assert (a["backward_input_s"], a["backward_weight_s"]) == (1.5e-3, 1.5e-3)
    assert a["weight_grad_activation_bytes"] == 100  # unmeasured: W keeps every activation
    assert (b["backward_input_s"], b["backward_weight_s"]) == (3e-3, 0.0)
    assert (c["backward_input_s"], c["backward_weight_s"]) == (1e-3, 4e-3)  # need not add up
    with pytest.raises(CostError, match="'backward_weight_s' must be a finite number >= 0"):
        g.add_node("d", backward_weight_s=-1.0)
    with pytest.raises(CostError, match="weight_grad_activation_bytes=9 is above activation"):
        g.add_node("e", activation_bytes=8, weight_grad_activation_bytes=9)
    g.graph.nodes["a"]["weight_grad_activation_bytes"] = 101
    with pytest.raises(CostError, match="node 'a': weight_grad_activation_bytes=101"):
        g.validate()


def test_json_round_trip_and_version_1_files() -> None:
    g = chain()
    text = g.to_json()
    assert json.loads(text)["nodes"][2]["backward_weight_s"] == 3e-3
    assert CostGraph.from_json(text) == g
    old = json.loads(text)
    old["version"] = 1
    for name in ("loss_forward_s", "loss_backward_s", "optimizer",  # added in version 3
                 "rows", "loss_row_s"):  # and 4  # fmt: skip
        del old[name]
    for record in old["nodes"]:
        for name in ("backward_input_s", "backward_weight_s", "weight_grad_activation_bytes"):
            del record[name]
        for name in ("optimizer_s", "forward_spread", "backward_spread",  # 3
                     "row_s", "accumulate_s"):  # and 4  # fmt: skip
            del record[name]
    back = CostGraph.from_json(json.dumps(old))
    for node in g.nodes:
        attrs = back.graph.nodes[node]
        assert attrs["backward_input_s"] == attrs["backward_weight_s"] == attrs["backward_s"] / 2
        assert attrs["weight_grad_activation_bytes"] == attrs["activation_bytes"]
    del old["nodes"][1]["backward_s"]
    with pytest.raises(CostError, match=r"node #1 'n0': missing fields \['backward_s'\]"):
        CostGraph.from_json(json.dumps(old))
    new = json.loads(text)
    del new["nodes"][1]["backward_input_s"]  # version 2 and 3 files carry every field
    with pytest.raises(CostError, match=r"missing fields \['backward_input_s'\]"):
        CostGraph.from_json(json.dumps(new))


def test_coarsening_sums_and_scaling_scales() -> None:
    g = chain()
    layers = coarsen(g, 3)  # the input, then two layers
    for _, layer in layers.graph.nodes(data=True):
        members = [g.graph.nodes[m] for m in layer["members"]]
        for name in ("backward_input_s", "backward_weight_s"):
            assert layer[name] == math.fsum(m[name] for m in members)
        kept = sum(m["weight_grad_activation_bytes"] for m in members)
        assert layer["weight_grad_activation_bytes"] == kept
    assert len(layers.graph.nodes["L001"]["members"]) > 1
    for name in ("backward_input_s", "backward_weight_s", "weight_grad_activation_bytes"):
        assert layers.totals()[name] == g.totals()[name]
    double = g.scaled(16).graph.nodes["n1"]
    assert (double["backward_input_s"], double["backward_weight_s"]) == (3e-3, 6e-3)
    assert double["weight_grad_activation_bytes"] == 602


def test_pipedream_import_gives_half_of_the_backward_to_each_part() -> None:
    g = CostGraph.from_pipedream(DATA / "vgg16" / "graph.txt", batch_size=64)
    assert any(a["backward_s"] > 0 for _, a in g.graph.nodes(data=True))
    for _, attrs in g.graph.nodes(data=True):
        assert attrs["backward_input_s"] == attrs["backward_weight_s"] == attrs["backward_s"] / 2
        assert attrs["weight_grad_activation_bytes"] == attrs["activation_bytes"]


def test_plan_stages_carry_the_split(tmp_path) -> None:
    g = chain()
    plan = pdcompile.plan(g, "2", solver="dp", num_microbatches=4)
    total_input = total_weight = 0.0
    for stage in plan.stages:
        nodes = [g.graph.nodes[n] for n in stage.nodes if g.graph.nodes[n]["kind"] != "input"]
        assert stage.backward_input_s == math.fsum(a["backward_input_s"] for a in nodes)
        assert stage.backward_weight_s == math.fsum(a["backward_weight_s"] for a in nodes)
        # what the runtime keeps from I to W (docs/memory.md): at least what W reads
        assert stage.weight_grad_activation_bytes == kept_for_weights(g, stage.nodes)
        assert stage.weight_grad_activation_bytes >= sum(
            g.graph.nodes[n]["weight_grad_activation_bytes"] for n in stage.nodes
        )
        total_input += stage.backward_input_s
        total_weight += stage.backward_weight_s
    assert math.isclose(total_input, g.totals()["backward_input_s"])
    assert math.isclose(total_weight, g.totals()["backward_weight_s"])

    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    doc = json.loads(plan.to_json())
    for stage in doc["stages"]:  # a plan of an older pdcompile
        for name in ("backward_input_s", "backward_weight_s", "weight_grad_activation_bytes"):
            del stage[name]
    old = Plan.from_json(json.dumps(doc))
    for stage in old.stages:
        assert stage.backward_input_s == stage.backward_weight_s == stage.backward_s / 2
        assert stage.weight_grad_activation_bytes == stage.activation_bytes

    twice = rescore(plan.with_(microbatch_size=8), microbatch_size=16)
    assert twice.stages[0].backward_weight_s == 2 * plan.stages[0].backward_weight_s
    assert twice.stages[0].weight_grad_activation_bytes == round(
        2 * plan.stages[0].weight_grad_activation_bytes
    )
