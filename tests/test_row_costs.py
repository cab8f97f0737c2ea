"""Costs as a function of the rows per microbatch (issue 29): the curves of a CostGraph profiled at
several row counts, how everything that rescales costs follows them, and graphs of one profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import pdcompile
from pdcompile import CostGraph
from pdcompile.core.errors import CostError
from pdcompile.core.row_curves import monotone, value_at
from pdcompile.passes.coarsening import coarsen
from pdcompile.passes.planning.evaluation import rescore
from pdcompile.passes.planning.replan_decision import StageTime, rescaled
from pdcompile.passes.planning.stage_sums import node_sums

TIMES = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s")
DATA = Path(__file__).parent / "data" / "pipedream"


def curved() -> CostGraph:
    """A chain input -> fc1 -> relu -> fc2 -> output at 4 rows, profiled at 1, 4 and 16 rows: the
    Linears mostly fixed (their weights), the ReLU per row, and one node without a curve."""
    points = {
        "fc1": ((1e-3, 2e-3, 1e-3, 1e-3), (1.2e-3, 2.4e-3, 1.2e-3, 1.2e-3),
                (2e-3, 4e-3, 2e-3, 2e-3)),
        "relu": ((1e-5, 1e-5, 1e-5, 0.0), (4e-5, 4e-5, 4e-5, 0.0), (1.6e-4, 1.6e-4, 1.6e-4, 0.0)),
        "fc2": ((5e-4, 1e-3, 5e-4, 5e-4), (6e-4, 1.2e-3, 6e-4, 6e-4), (1e-3, 2e-3, 1e-3, 1e-3)),
    }  # fmt: skip
    g = CostGraph(
        batch_size=4, rows=(1, 4, 16), optimizer="sgd", loss_forward_s=2e-4, loss_backward_s=4e-4,
        loss_row_s=((1e-4, 2e-4), (2e-4, 4e-4), (6e-4, 1.2e-3)),
    )  # fmt: skip
    g.add_node("x", kind="input", output_bytes=4 * 256)
    for name, row_s in points.items():
        at_4 = dict(zip(TIMES, row_s[1], strict=True))
        g.add_node(name, **at_4, row_s=row_s, param_bytes=4096 if "fc" in name else 0,
                   grad_bytes=4096 if "fc" in name else 0, activation_bytes=4 * 256,
                   output_bytes=4 * 256, accumulate_s=1e-5 if "fc" in name else 0.0)  # fmt: skip
    g.add_node("out", kind="output", forward_s=1e-6, backward_s=1e-6)  # no curve: linear
    for u, v in (("x", "fc1"), ("fc1", "relu"), ("relu", "fc2"), ("fc2", "out")):
        g.add_edge(u, v, bytes=4 * 256)
    return g


def flat(g: CostGraph) -> CostGraph:
    """`g` as one profile: no row counts, no curves."""
    graph = g.graph.copy()
    for _, data in graph.nodes(data=True):
        data["row_s"] = None
    return CostGraph(graph, g.batch_size, g.meta, **{**g.step_costs(), "rows": (),
                                                     "loss_row_s": None})  # fmt: skip


def times(g: CostGraph) -> dict:
    return {n: tuple(d[t] for t in TIMES) for n, d in g.graph.nodes(data=True)}


def test_curves_read_their_points_between_and_beyond() -> None:
    rows, values = (1, 4, 16), (1.0, 1.3, 2.5)
    assert [value_at(rows, values, n) for n in rows] == list(values)
    assert value_at(rows, values, 2) == pytest.approx(1.1)  # between 1 and 4
    assert value_at(rows, values, 32) == pytest.approx(2.5 + 16 * 0.1)  # the last two's line
    assert value_at((4, 8), (1.0, 3.0), 1) == 0.0  # below the smallest: never below 0
    assert monotone([3.0, 2.0, 1.0, 4.0, 3.0], keep=2) == (1.0, 1.0, 1.0, 4.0, 4.0)


def test_scaled_reads_the_curves_and_keeps_them() -> None:
    g = curved()
    assert "measured at rows 1, 4, 16" in str(g) and g.row_scaling == "measured at rows 1, 4, 16"
    assert times(g.scaled(1))["fc1"] == (1e-3, 2e-3, 1e-3, 1e-3)  # a profiled point, exact
    assert g.scaled(8).graph.nodes["fc1"]["forward_s"] == pytest.approx(1.2e-3 + 4 * 0.8e-3 / 12)
    assert g.scaled(32).graph.nodes["fc1"]["forward_s"] == pytest.approx(2e-3 + 16 * 0.8e-3 / 12)
    assert g.scaled(8).graph.nodes["out"]["forward_s"] == 2e-6  # no curve: linear
    assert g.scaled(16).loss_s == pytest.approx(1.8e-3)
    assert g.scaled(8).graph.nodes["fc1"]["activation_bytes"] == 8 * 256  # bytes: linear
    assert g.scaled(8).graph.nodes["fc1"]["accumulate_s"] == 1e-5  # per microbatch
    for a in (1, 3, 4, 7, 16, 40):  # the points kept: exactly (linear nodes to rounding)
        for b in (1, 5, 16, 33):
            twice, once = times(g.scaled(a).scaled(b)), times(g.scaled(b))
            assert twice.pop("out") == pytest.approx(once.pop("out")) and twice == once, (a, b)
            assert g.scaled(a).scaled(b).loss_s == g.scaled(b).loss_s
    totals = [g.scaled(n).totals() for n in range(1, 65)]
    for name in TIMES:
        column = [t[name] for t in totals]
        assert column == sorted(column), name  # more rows never cost less
    again = g.copy()
    for name in TIMES:  # an edit in place (the closed loop, a user) scales the curve alike
        again.graph.nodes["fc1"][name] *= 3
    assert again.scaled(16).graph.nodes["fc1"]["forward_s"] == pytest.approx(3 * 2e-3)


def test_one_profile_scales_linearly_and_says_so(tmp_path: Path) -> None:
    one = flat(curved())
    assert one.row_scaling == "assumed linear (one profile)" and "assumed linear" in str(one)
    assert one.scaled(8).graph.nodes["fc1"]["forward_s"] == 2 * 1.2e-3
    doc = json.loads(curved().to_json())
    doc["version"] = 3  # a file written before the curves
    for name in ("rows", "loss_row_s"):
        del doc[name]
    for record in doc["nodes"]:
        del record["row_s"], record["accumulate_s"]
    old = CostGraph.from_json(json.dumps(doc))
    assert old.rows == () and old.loss_row_s is None and old.row_scaling.startswith("assumed")
    assert old.scaled(8).graph.nodes["relu"]["forward_s"] == 2 * 4e-5
    assert all(d["accumulate_s"] == 0.0 for _, d in old.graph.nodes(data=True))
    imported = CostGraph.from_pipedream(DATA / "vgg16" / "graph.txt", batch_size=64)
    assert imported.rows == () and "assumed linear (one profile)" in str(imported)
    before = next(iter(imported.graph.nodes(data="backward_s")))
    assert imported.scaled(32).graph.nodes[before[0]]["backward_s"] == before[1] / 2


def test_json_round_trip_of_the_curves(tmp_path: Path) -> None:
    g = curved()
    doc = json.loads(g.to_json())
    assert doc["version"] == 4 and doc["rows"] == [1, 4, 16] and len(doc["loss_row_s"]) == 3
    assert doc["nodes"][1]["row_s"][0] == [1e-3, 2e-3, 1e-3, 1e-3]
    assert doc["nodes"][4]["row_s"] is None
    g.save(tmp_path / "g.json")
    back = CostGraph.load(tmp_path / "g.json")
    assert back == g and back.to_json() == g.to_json()
    assert times(back.scaled(7)) == times(g.scaled(7))
    doc["nodes"][2]["row_s"][2][0] = 1e-6  # fewer seconds at more rows
    with pytest.raises(CostError, match="node 'relu': row_s: part 0 decreases with the rows"):
        CostGraph.from_json(json.dumps(doc))
    doc = json.loads(g.to_json())
    doc["nodes"][2]["row_s"] = doc["nodes"][2]["row_s"][:2]
    with pytest.raises(CostError, match="node 'relu': row_s has 2 entries, the graph's rows are"):
        CostGraph.from_json(json.dumps(doc))


def test_coarsening_sums_the_curves() -> None:
    g = curved()
    layers = coarsen(g, 3)
    assert layers.rows == g.rows and layers.loss_row_s == g.loss_row_s
    for n in (1, 2, 4, 9, 16, 50):
        ours, theirs = layers.scaled(n).totals(), g.scaled(n).totals()
        for name in (*TIMES, "accumulate_s"):
            assert ours[name] == pytest.approx(theirs[name], rel=1e-12), (n, name)


def test_rescaled_and_rescore_follow_the_curves() -> None:
    g = curved()
    plan = pdcompile.plan(g, 2, schedule="1f1b", num_microbatches=4, microbatch_size=8)
    assert "times at 8 rows per microbatch: measured at rows 1, 4, 16" in str(plan)
    # the closed loop: stages measured twice as slow as priced; the rescaled costs, priced at
    # the plan's rows on their curves, give the measured times
    measured = {s.index: StageTime(2 * s.forward_s, 2 * s.backward_s, 4) for s in plan.stages}
    fixed = rescaled(g, plan, measured)
    for s in plan.stages:
        sums = node_sums(fixed.scaled(8), s.nodes)
        assert sums.forward_s + sums.loss_forward_s == pytest.approx(measured[s.index].forward_s)
        node = next(n for n in s.nodes if fixed.graph.nodes[n]["row_s"] is not None)
        new, old = fixed.graph.nodes[node], g.graph.nodes[node]
        assert new["row_s"][0][0] / old["row_s"][0][0] == pytest.approx(
            new["forward_s"] / old["forward_s"]
        )
    # rescore without the CostGraph: the stages' curves it kept give what pricing the same
    # partition on the costs at those rows gives
    for rows in (1, 3, 16, 40):
        again = rescore(plan, microbatch_size=rows)
        priced = pdcompile.evaluate(plan.with_(microbatch_size=rows), g.scaled(rows))
        for ours, theirs in zip(again.stages, priced.stages, strict=True):
            for name in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s",
                         "loss_s"):  # fmt: skip
                assert getattr(ours, name) == pytest.approx(getattr(theirs, name)), (rows, name)
        assert again.lower_bound == pytest.approx(priced.lower_bound)


def test_the_count_search_pays_the_fixed_part_and_the_accumulation() -> None:
    g = curved()
    one = pdcompile.plan(g, 1, schedule="1f1b", num_microbatches=1, microbatch_size=4)
    four = pdcompile.plan(g, 1, schedule="1f1b", num_microbatches=4, microbatch_size=4)
    free = flat(g)
    for _, data in free.graph.nodes(data=True):
        data["accumulate_s"] = 0.0
    unpriced = pdcompile.plan(free, 1, schedule="1f1b", num_microbatches=4, microbatch_size=4)
    # every microbatch after an update's first adds the two Linears' gradients to those held
    assert four.step_time - unpriced.step_time == pytest.approx(3 * 2e-5)
    assert one.step_time < four.step_time
    pipeline = dict(schedule="1f1b", global_batch_size=64, replica_counts=[1])  # two stages
    chosen = pdcompile.plan(g, "2@1.25Gbit/s", **pipeline)
    before = pdcompile.plan(free, "2@1.25Gbit/s", **pipeline)
    assert before.num_microbatches == 64 and chosen.num_microbatches < 16
    truth = pdcompile.evaluate(before.with_(microbatch_size=1), g.scaled(1))
    assert chosen.step_time < truth.step_time  # the linear costs' choice, priced on the curves


class Wide(nn.Module):
    """Two Linear(256 -> 512 -> 512): their weights are most of a small batch's work."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _spread(g: CostGraph, time: str, spread: str) -> float:
    total = sum(d[time] for _, d in g.graph.nodes(data=True))
    return sum(d[time] * d[spread] for _, d in g.graph.nodes(data=True)) / total


def test_analytic_curves_charge_the_weights_once_per_microbatch() -> None:
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(16, 256)
    costs = pdcompile.analyze(pdcompile.trace(model, (x[:4],)), (x[:4],), profile=False,
                              rows=(1, 4, 16), calibration=False)  # fmt: skip
    assert costs.rows == (1, 4, 16) and costs.row_scaling == "priced at rows 1, 4, 16"
    one = pdcompile.analyze(pdcompile.trace(model, (x[:1],)), (x[:1],), profile=False, rows=(),
                            calibration=False)  # fmt: skip
    assert costs.scaled(1).totals()["forward_s"] == pytest.approx(one.totals()["forward_s"])
    # a roofline reads a Linear's weights once per microbatch: 1 row costs far more than 1/4
    assert costs.scaled(1).totals()["forward_s"] > 0.5 * costs.totals()["forward_s"]


def test_profiled_costs_at_rows_never_profiled_match_a_profile_there() -> None:
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(16, 256)
    settings = dict(cache=False, calibration=False, progress=False)
    costs = pdcompile.analyze(pdcompile.trace(model, (x[:4],)), (x[:4],), rows=(1, 4, 16),
                              **settings)  # fmt: skip
    at_8 = pdcompile.analyze(pdcompile.trace(model, (x[:8],)), (x[:8],), rows=(), **settings)
    assert costs.rows == (1, 4, 16) and at_8.rows == ()
    totals = [costs.scaled(n).totals() for n in range(1, 33)]
    for name in TIMES:
        column = [t[name] for t in totals]
        assert column == sorted(column), name
    predicted, measured = totals[7], at_8.totals()
    for time, spread in (("forward_s", "forward_spread"), ("backward_s", "backward_spread")):
        within = _spread(costs, time, spread) + _spread(at_8, time, spread) + 0.25
        assert abs(predicted[time] / measured[time] - 1) <= within, (time, predicted, measured)
    assert costs.graph.nodes["net_2"]["accumulate_s"] > 0  # a 1 MiB weight's gradient added


def test_a_row_count_the_model_cannot_run_is_left_out_with_a_warning() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).train()  # not on 1 row in training
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="costs at 1 rows per microbatch were not measured"):
        costs = pdcompile.analyze(pdcompile.trace(model, (x,)), (x,), profile=False,
                                  rows=(1, 2, 4), calibration=False)  # fmt: skip
    assert costs.rows == (2, 4) and "left_out" in costs.meta["row_profiles"]["1"]


def test_node_points_are_kept_until_the_node_changes() -> None:
    """`CostGraph.node_points` keeps a node's anchored points for the planner's many prices, and
    reads them again once a time, the points or the batch size change."""
    g = curved()
    first = g.node_points("fc1")
    assert g.node_points("fc1") is first  # kept
    assert first[1] == pytest.approx((1.2e-3, 2.4e-3, 1.2e-3, 1.2e-3))  # anchored at 4 rows
    g.graph.nodes["fc1"]["forward_s"] *= 2  # an edit in place (the closed loop's `rescaled`)
    doubled = g.node_points("fc1")
    assert [p[0] for p in doubled] == pytest.approx([2 * p[0] for p in first])
    g.graph.nodes["fc1"]["row_s"] = tuple((2 * a, b, c, d) for a, b, c, d in first)
    assert g.node_points("fc1")[0][0] == pytest.approx(doubled[0][0])  # anchored at 4 rows
    g.batch_size = 16  # the same times read as 16 rows': the curve moves to meet them there
    assert g.node_points("fc1")[2][0] == pytest.approx(g.graph.nodes["fc1"]["forward_s"])
