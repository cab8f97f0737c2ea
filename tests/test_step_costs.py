"""Everything a step does is priced: the loss function (CostGraph `loss_forward_s` /
`loss_backward_s`, on the stage holding the output) and the optimizer step (node `optimizer_s`),
in the CostGraph, its JSON, the solvers, `evaluate`, the simulator and plan files."""

from __future__ import annotations

import json

import pytest

from pdcompile.cost_graph import CostGraph
from pdcompile.errors import CostError
from pdcompile.passes.coarsening import coarsen


def chain(loss_s: float = 0.0, optimizer_s: float = 0.0, n: int = 4) -> CostGraph:
    """x -> n0 .. n{n-1} -> out: equal nodes of 1 s forward and 2 s backward, 100 parameter
    bytes each; the loss split 1:2 like the nodes."""
    g = CostGraph(
        batch_size=8, meta={"source": "test"}, loss_forward_s=loss_s / 3,
        loss_backward_s=2 * loss_s / 3, optimizer="sgd" if optimizer_s else "",
    )  # fmt: skip
    g.add_node("x", kind="input", output_bytes=64)
    previous = "x"
    for i in range(n):
        g.add_node(
            f"n{i}", forward_s=1.0, backward_s=2.0, param_bytes=100, grad_bytes=100,
            activation_bytes=64, output_bytes=64, optimizer_s=optimizer_s,
            forward_spread=0.1 * i, backward_spread=0.05,
        )  # fmt: skip
        g.add_edge(previous, f"n{i}", 64)
        previous = f"n{i}"
    g.add_node("out", kind="output")
    g.add_edge(previous, "out", 64)
    return g


# -- the CostGraph ---------------------------------------------------------------------------


def test_new_attributes_default_to_zero_and_are_checked() -> None:
    g = CostGraph(batch_size=2)
    g.add_node("a", forward_s=1.0)
    data = g.graph.nodes["a"]
    assert (data["optimizer_s"], data["forward_spread"], data["backward_spread"]) == (0, 0, 0)
    assert (g.loss_forward_s, g.loss_backward_s, g.loss_s, g.optimizer) == (0.0, 0.0, 0.0, "")
    with pytest.raises(CostError, match="'optimizer_s' must be a finite number >= 0"):
        g.add_node("b", optimizer_s=-1.0)
    with pytest.raises(CostError, match="loss_forward_s must be a finite number of seconds"):
        CostGraph(loss_forward_s=float("nan"))
    with pytest.raises(CostError, match="optimizer must be a string"):
        CostGraph(optimizer=None)  # type: ignore[arg-type]
    g.loss_backward_s = -1.0
    with pytest.raises(CostError, match="loss_backward_s must be a finite number"):
        g.validate()


def test_loss_node_and_compute_times() -> None:
    g = chain(loss_s=3.0)
    assert g.loss_s == pytest.approx(3.0) and g.loss_node == "out"
    assert g.compute_times() == [0.0, 3.0, 3.0, 3.0, 3.0, pytest.approx(3.0)]
    assert g.compute_times(["n1", "out"]) == [3.0, pytest.approx(3.0)]
    bare = CostGraph()
    assert bare.loss_node is None
    bare.add_node("a", forward_s=1.0)
    bare.add_node("b", forward_s=1.0)
    assert bare.loss_node == "b"  # no output node: the last node


def test_scaling_scales_the_loss_not_the_step_nor_the_spread() -> None:
    g = chain(loss_s=3.0, optimizer_s=0.5)
    half = g.scaled(4)
    assert half.loss_forward_s == g.loss_forward_s / 2
    assert half.loss_backward_s == g.loss_backward_s / 2
    assert half.optimizer == "sgd"
    for node in g.nodes:
        for name in ("optimizer_s", "forward_spread", "backward_spread"):
            assert half.graph.nodes[node][name] == g.graph.nodes[node][name]
    assert half.graph.nodes["n1"]["forward_s"] == 0.5
    assert g.copy() == g and g.copy().loss_s == g.loss_s
    assert g != chain(loss_s=1.0, optimizer_s=0.5)


def test_coarsening_keeps_the_loss_sums_the_step_and_weighs_the_spread() -> None:
    g = chain(loss_s=3.0, optimizer_s=0.5)
    layers = coarsen(g, 3)
    assert layers.step_costs() == g.step_costs()
    assert layers.totals()["optimizer_s"] == g.totals()["optimizer_s"] == 2.0
    assert math_close(sum(layers.compute_times()), sum(g.compute_times()))
    for _, layer in layers.graph.nodes(data=True):
        members = [g.graph.nodes[m] for m in layer["members"]]
        time = sum(m["forward_s"] for m in members)
        if time:
            expected = sum(m["forward_spread"] * m["forward_s"] for m in members) / time
            assert layer["forward_spread"] == pytest.approx(expected)


def math_close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 * max(1.0, abs(a), abs(b))


def test_json_round_trip_and_older_files_load_with_zeros() -> None:
    g = chain(loss_s=3.0, optimizer_s=0.5)
    text = g.to_json()
    doc = json.loads(text)
    assert doc["version"] == 3 and doc["optimizer"] == "sgd"
    assert (doc["loss_forward_s"], doc["loss_backward_s"]) == (1.0, 2.0)
    assert doc["nodes"][1]["optimizer_s"] == 0.5 and doc["nodes"][2]["forward_spread"] == 0.1
    back = CostGraph.from_json(text)
    assert back == g and back.to_json() == text
    old = json.loads(text)
    old["version"] = 2
    for name in ("loss_forward_s", "loss_backward_s", "optimizer"):
        del old[name]
    for record in old["nodes"]:
        for name in ("optimizer_s", "forward_spread", "backward_spread"):
            del record[name]
    back = CostGraph.from_json(json.dumps(old))
    assert (back.loss_s, back.optimizer) == (0.0, "")
    assert all(back.graph.nodes[n]["optimizer_s"] == 0.0 for n in back.nodes)
    assert all(back.graph.nodes[n]["forward_spread"] == 0.0 for n in back.nodes)
    with pytest.raises(CostError, match=r"unknown \['loss_backward_s', 'loss_forward_s'"):
        CostGraph.from_json(json.dumps({**old, "loss_forward_s": 0.0, "loss_backward_s": 0.0}))
    del doc["optimizer"]
    with pytest.raises(CostError, match=r"missing \['optimizer'\]"):
        CostGraph.from_json(json.dumps(doc))


def test_str_shows_the_loss_and_the_step_when_priced() -> None:
    text = str(chain(loss_s=3.0, optimizer_s=0.5))
    assert "loss per batch: forward 1.00 s, backward 2.00 s; optimizer step: 2.00 s (sgd)" in text
    assert "loss per batch" not in str(chain())
