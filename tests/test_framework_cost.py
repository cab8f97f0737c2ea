"""The per-operation framework cost: the fit, the counts on known nodes, the fold (analytic:
added; profiled: carved out of the measured backward), the cache and its provenance, the CLI.

Nothing here asserts a measured time: the fit runs on synthetic timings, calibrations are
scripted (`scripted`) except one that only checks its shape, and the profile's timer is
scripted as in tests/test_profile_cache.py.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import replace
from datetime import datetime

import pytest
import torch
import torch.nn as nn
from support import example

import pdcompile
from pdcompile.cli.handlers import main
from pdcompile.core.errors import CostError
from pdcompile.core.ir import ANALYTIC_S, ANALYTIC_SPLIT_S, FOLDED_S, FRAMEWORK_OPS, MEASURED_S
from pdcompile.passes import framework_cost
from pdcompile.passes import profile as profile_pass
from pdcompile.passes.framework_cost import Fit, FrameworkCost, calibrate, fit_slope
from pdcompile.passes.framework_fold import OperationCounts, fold_profiled

COST = FrameworkCost(
    forward_op_s=1e-6, backward_node_s=2e-6, backward_op_s=5e-7, spread=(0.0, 0.0, 0.0),
    device="cpu", num_threads=1, torch_version=torch.__version__, host="test",
    measured_at="2025-01-01T00:00:00+00:00",
)  # fmt: skip


def scripted(monkeypatch) -> list[int]:
    """Calibrations measure nothing: their slopes are 3 us per operation forward, 4 us per node
    and 1 us per operation backward. Returns the call counter."""
    calls = [0]

    def measure(device, repeats, warmup):
        calls[0] += 1
        return Fit(3e-6, 1e-5, 0.01), Fit(4e-6, 2e-5, 0.02), Fit(1e-6, 0.0, 0.03)

    monkeypatch.setattr(framework_cost, "_measure", measure)
    return calls


def test_fit_slope_on_synthetic_timings() -> None:
    counts = [0, 32, 64, 128, 192]
    exact = fit_slope(counts, [1e-5 + 7e-6 * c for c in counts])
    assert exact.slope == pytest.approx(7e-6) and exact.intercept == pytest.approx(1e-5)
    assert exact.spread == pytest.approx(0.0, abs=1e-9)
    # one chain slowed threefold by another process moves Theil-Sen's slope little
    disturbed = fit_slope(counts, [1e-5 + 7e-6 * c * (3 if c == 64 else 1) for c in counts])
    least_squares = float(torch.linalg.lstsq(
        torch.tensor([[c, 1.0] for c in counts], dtype=torch.float64),
        torch.tensor([[1e-5 + 7e-6 * c * (3 if c == 64 else 1)] for c in counts],
                     dtype=torch.float64),
    ).solution[0, 0])  # fmt: skip
    assert disturbed.slope == pytest.approx(7e-6) and abs(least_squares - 7e-6) > 5e-7
    fit = fit_slope([0, 10, 20, 30, 40], [1.0, 2.0, 3.0, 4.0, 20.0])
    assert (fit.slope, fit.intercept, round(fit.spread, 2)) == (0.1, 1.0, 4.69)
    with pytest.raises(CostError, match="two distinct counts"):
        fit_slope([5, 5], [1.0, 2.0])
    with pytest.raises(CostError, match="2 counts but 1 times"):
        fit_slope([1, 2], [1.0])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def counts_of(model: nn.Module, *inputs: torch.Tensor) -> tuple[torch.fx.GraphModule, dict]:
    gm = pdcompile.trace(model, inputs)
    pdcompile.analyze(gm, inputs, profile=False, calibration=COST, progress=False)
    return gm, {n.name: n.meta[FRAMEWORK_OPS] for n in gm.graph.nodes}


def test_operations_are_counted_exactly_on_known_nodes() -> None:
    _, counts = counts_of(Net(), torch.randn(4, 8))
    # forward: t + addmm; backward: AddmmBackward0 (t, mm, t, sum, view, t: the data needs no
    # gradient) and TBackward0 (t), and two AccumulateGrads (weight, bias) of one operation each;
    # all of it is W
    assert counts["fc1"] == OperationCounts(2, 4, 0, 4, 2, 8, 0, 8)
    # relu and the detach autograd makes of the output it saves; ReluBackward0 (unpacking it,
    # threshold_backward), all I
    assert counts["relu"] == OperationCounts(2, 1, 1, 0, 0, 2, 2, 0)
    # both kinds: AddmmBackward0 computes I and W alike, so it is in both parts; I runs t and mm
    assert counts["fc2"] == OperationCounts(2, 4, 1, 4, 2, 10, 2, 8)
    assert counts["x"] == counts["output"] == OperationCounts()


def test_a_tied_weight_is_accumulated_once_by_its_owner_and_clones_are_not_counted() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids)
            h = h.relu_()  # in place: run on a clone of its input, which is not its work
            return h @ self.emb.weight.t()

    _, counts = counts_of(Tied(), torch.randint(0, 16, (2, 3)))
    assert counts["emb"].accumulate == 1 and counts["emb"].backward == 2  # Embedding, Accumulate
    assert counts["relu_"].backward == 1 and counts["relu_"].backward_input == 1
    assert sum(c.accumulate for c in counts.values()) == 1  # one parameter tensor


def test_calibration_off_leaves_analytic_times_and_on_replaces_the_overhead_exactly(
    tmp_path,
) -> None:
    gm = pdcompile.trace(Net(), (x := torch.randn(4, 8),))
    off = pdcompile.analyze(gm, (x,), profile=False, calibration=False, progress=False)
    assert off.meta["framework"] is None and not any(FOLDED_S in n.meta for n in gm.graph.nodes)
    for n in gm.graph.nodes:
        a = off.graph.nodes[n.name]
        assert (a["forward_s"], a["backward_s"]) == n.meta[ANALYTIC_S]
    on = pdcompile.analyze(gm, (x,), profile=False, calibration=COST, progress=False)
    overhead = pdcompile.DeviceModel.get("cpu").overhead_s
    for n in gm.graph.nodes:
        c, a = n.meta[FRAMEWORK_OPS], on.graph.nodes[n.name]
        times = (*n.meta[ANALYTIC_S], *n.meta[ANALYTIC_SPLIT_S])
        counted = (
            c.forward * 1e-6,
            c.backward * 2e-6 + c.backward_ops * 5e-7,
            c.backward_input * 2e-6 + c.backward_input_ops * 5e-7,
            c.backward_weight * 2e-6 + c.backward_weight_ops * 5e-7,
        )
        for attr, t, k in zip(("forward_s", "backward_s", "backward_input_s",
                               "backward_weight_s"), times, counted, strict=True):  # fmt: skip
            assert a[attr] == pytest.approx((t - overhead if t > 0 else 0.0) + k, rel=1e-12)
    framework = on.meta["framework"]
    assert framework["mode"] == "analytic" and framework["cost"] == COST.to_dict()
    assert framework["forward_s"] == pytest.approx(6 * 1e-6)  # three nodes of 2 operations
    assert pdcompile.CostGraph.from_json(on.to_json()) == on
    # True without profiling folds only a cached calibration (none in this empty cache)
    empty = pdcompile.analyze(gm, (x,), profile=False, calibration=True, cache=tmp_path)
    assert empty.meta["framework"] is None
    with pytest.raises(CostError, match="calibration must be True, False or a FrameworkCost"):
        pdcompile.analyze(gm, (x,), profile=False, calibration="yes")


def test_the_profiled_fold_carves_the_framework_out_of_the_measured_backward() -> None:
    cost = FrameworkCost(0.5, 1.0, 0.0, (0.0, 0.0, 0.0), "cpu", 1, "t", "h", "2025-01-01T00:00")
    counts = {"a": OperationCounts(2, 4, 1, 4, 2), "b": OperationCounts(2, 1, 1, 0, 0)}
    # a's backward alone (less the grad call) was 5, I 3, W 2.5, scaled by 2 to the whole's 10;
    # b's was below resolution (0)
    times = {"a": (1.0, 10.0, 6.0, 5.0), "b": (1.0, 0.0, 0.0, 0.0)}
    folded, share, q = fold_profiled(times, counts, cost, 10.0, 2.0)
    # framework 4 + 1 = 5 of the whole 10; a's compute: 5 - (4 - 2 - 1) = 4 takes the other 5
    assert q == 1.0 and share["a"] == (1.0, 4.0, 1.0, 4.0) and share["b"] == (1.0, 1.0, 1.0, 0.0)
    assert folded["a"] == pytest.approx((1.0, 4 + 4 * 1.25, 1 + 3 * 1.25, 4 + 1.5 * 1.25))
    assert folded["b"] == pytest.approx((1.0, 1.0, 1.0, 0.0))
    assert math.fsum(f[1] for f in folded.values()) == pytest.approx(10.0)  # the whole, kept
    # a calibration above the whole backward measured is scaled down to fit it
    folded, _, q = fold_profiled(times, counts, cost, 3.0, 0.6)
    assert q == pytest.approx(0.6) and folded["a"][1] == pytest.approx(2.4)
    assert math.fsum(f[1] for f in folded.values()) == pytest.approx(3.0)
    # nothing but framework left: the whole is shared by counts
    quiet = {"a": (1.0, 0.0, 0.0, 0.0), "b": (1.0, 0.0, 0.0, 0.0)}
    folded, _, q = fold_profiled(quiet, counts, cost, 10.0, 1.0)
    assert q == 2.0 and (folded["a"][1], folded["b"][1]) == (8.0, 2.0)
    # operations count too: a's 6 in context (2 in its AccumulateGrads), 4 of them alone, less
    # the grad call's 1: 3 x 0.25 more taken off its alone time, 6 x 0.25 more framework
    ops = {"a": replace(counts["a"], backward_ops=6), "b": counts["b"]}
    folded, share, _ = fold_profiled(times, ops, replace(cost, backward_op_s=0.25), 10.0, 2.0)
    assert share["a"][1] == 4.0 + 1.5 and share["b"][1] == 1.0
    assert folded["a"][1] == pytest.approx(5.5 + (4 - 0.75) * (10 - 6.5) / (4 - 0.75))


def test_profiled_costs_keep_their_totals_and_forwards(tmp_path, monkeypatch) -> None:
    model, args, kwargs = example("mlp")
    gm = pdcompile.trace(model, args, example_kwargs=kwargs)
    monkeypatch.setattr(profile_pass, "MAX_SLOWDOWN", math.inf)  # caching is not tested here
    on = pdcompile.analyze(gm, args, cache=tmp_path, calibration=COST, progress=False)
    measured = {n.name: n.meta[MEASURED_S] for n in gm.graph.nodes}
    counts = {n.name: n.meta[FRAMEWORK_OPS] for n in gm.graph.nodes}
    off = pdcompile.analyze(gm, args, cache=tmp_path, calibration=False, progress=False)
    assert off.meta["profile"]["cached"]  # the same measurements, folded and not
    for name, (forward, backward) in measured.items():
        assert on.graph.nodes[name]["forward_s"] == off.graph.nodes[name]["forward_s"] == forward
        assert off.graph.nodes[name]["backward_s"] == backward
    assert on.totals()["backward_s"] == pytest.approx(off.totals()["backward_s"], rel=1e-9)
    q = on.meta["framework"]["scale"]
    for name, c in counts.items():  # every node at least its framework share
        share = (c.backward * 2e-6 + c.backward_ops * 5e-7) * q
        assert on.graph.nodes[name]["backward_s"] >= share * (1 - 1e-9)
    assert on.meta["framework"]["mode"] == "profile"


def test_the_calibration_is_cached_with_its_provenance(tmp_path, monkeypatch) -> None:
    calls = scripted(monkeypatch)
    first = calibrate(cache=tmp_path)
    (path,) = tmp_path.glob("framework-*.json")
    assert calls[0] == 1 and not first.cached and first.cache_path == str(path)
    assert (first.forward_op_s, first.backward_node_s, first.backward_op_s) == (3e-6, 4e-6, 1e-6)
    assert first.spread == (0.01, 0.02, 0.03)
    assert first.host == platform.node() and first.torch_version == torch.__version__
    assert first.device == "cpu" and first.num_threads == 1
    assert datetime.fromisoformat(first.measured_at).tzinfo is not None
    doc = json.loads(path.read_text())
    assert doc["format"] == framework_cost.CACHE_FORMAT and doc["calibration"]["host"]

    second = calibrate(cache=tmp_path)
    assert calls[0] == 1 and second.cached and second == replace(first, cached=True)
    assert "3 us per op forward, 4 us per node + 1 us per op backward (cpu, 1 thread" in (
        second.origin()
    )
    assert f"cached in {path}" in second.origin()
    calibrate(cache=tmp_path, num_threads=2)  # another thread count is another calibration
    assert calls[0] == 2 and len(list(tmp_path.glob("framework-*.json"))) == 2
    calibrate(cache=tmp_path, refresh=True)
    assert calls[0] == 3
    path.write_text("{not json")  # a damaged file is measured again, never an error
    assert not calibrate(cache=tmp_path).cached and calls[0] == 4

    # analyze folds the cached one without profiling, and measures one when profiling
    gm = pdcompile.trace(Net(), (x := torch.randn(4, 8),))
    costs = pdcompile.analyze(gm, (x,), profile=False, calibration=True, cache=tmp_path)
    assert costs.meta["framework"]["cost"]["cache_path"] == str(path) and calls[0] == 4


def test_a_real_calibration_is_quick_and_counts_its_chains() -> None:
    x = torch.rand(16).add_(0.5).requires_grad_()
    # mul, add, relu (+ the detach of its saved output), view, then the sum; backward: their
    # five nodes and the leaf's AccumulateGrad, running mul, (add: none), detach and
    # threshold_backward, view, expand (the sum's) and the accumulation
    assert framework_cost._counts(x, "mixed", 4) == (6, 6, 6)
    assert framework_cost._counts(x, "pass", 4) == (5, 6, 2)  # the adds run nothing backward
    cost = calibrate(cache=False, repeats=3, warmup=1, refresh=True)
    assert cost.forward_op_s >= 0 and cost.backward_node_s >= 0 and cost.cache_path is None
    assert calibrate(cache=False) is cost  # measured once per process without a disk cache


def test_cli_calibrate_prints_the_costs_and_where_they_are_kept(capsys, tmp_path,
                                                                 monkeypatch) -> None:  # fmt: skip
    scripted(monkeypatch)
    monkeypatch.setenv("PDCOMPILE_CACHE_DIR", str(tmp_path))
    out_json = tmp_path / "calibration.json"
    assert main(["calibrate", "--json", str(out_json)]) == 0
    out, err = capsys.readouterr()
    (path,) = tmp_path.glob("framework-*.json")
    assert (
        "per ATen operation" in out and "3.00 us" in out and "4.00 us" in out and "1.00 us" in out
    )
    assert "cached in" in out and f"wrote {out_json}" in err
    saved = FrameworkCost.from_dict(json.loads(out_json.read_text()))
    assert saved.cache_path == str(path) and saved.backward_node_s == 4e-6

    code = main(["profile", "pdcompile.zoo:mlp", "--analytic", "--calibration", "on"])
    out, _ = capsys.readouterr()
    assert code == 0 and "framework cost folded in (analytic): 3 us per op forward, 4 us" in out
    assert main(["profile", "pdcompile.zoo:mlp", "--analytic"]) == 0
    assert "framework cost folded" not in capsys.readouterr().out
