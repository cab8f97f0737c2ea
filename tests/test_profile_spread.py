"""Profiles that know their spread: per-time (p75 - p25) / median of the repeats, noisy times
measured again, those still noisy listed (with their rounds) and cached, old caches re-measured.

The timer is scripted, as in tests/test_profile_cache.py: every timed call returns 1 ms, except
in "noisy" rounds, where the nodes' forwards in two runs of the graph in five take 3 ms: each
forward's repeats are then [1, 1, 1, 3, 3] ms (or 6 of 1 and 4 of 3 in 10 repeats), a median at
the fastest (settled) but a spread of 2.
"""

from __future__ import annotations

import json
import logging
import math
import warnings

import pytest
from support import example

import pdcompile
from pdcompile.cli.handlers import main
from pdcompile.compiling.analysis import graph_inputs
from pdcompile.core.errors import UnsettledProfileWarning
from pdcompile.core.ir import MEASURED_SPREAD, PROFILE
from pdcompile.graph.node_runner import COMPUTE_OPS
from pdcompile.passes import profile as profile_pass
from pdcompile.passes import profile_cache
from pdcompile.passes.profile import _Alone, _Samples, _spread, _summarize, annotate_profile

QUIET, SLOW = 1e-3, 3e-3


def scripted_timer(monkeypatch, noisy_rounds: set[int]) -> list[int]:
    """Replace the timer (see the module); returns the round counter."""
    rounds = [0]

    def timer_for(device):
        rounds[0] += 1
        noisy, run = rounds[0] in noisy_rounds, [0]

        def timer(fn):
            fn()
            name = fn.__qualname__
            if "_backward_time" in name:  # the whole backward closes a run of the graph
                run[0] += 1
            elif noisy and "run_node" in name and run[0] % 5 >= 3:
                return SLOW
            return QUIET

        return timer

    monkeypatch.setattr(profile_pass, "device_timer", timer_for)
    return rounds


def mlp():
    model, args, kwargs = example("mlp")
    gm = pdcompile.trace(model, args, example_kwargs=kwargs)
    return gm, graph_inputs(gm, args, kwargs)


def profile(gm, inputs, cache):
    return annotate_profile(gm, inputs, warmup=1, repeats=5, cache=cache, progress=False)


def test_spread_is_the_interquartile_range_over_the_median() -> None:
    assert _spread([1.0, 2.0, 3.0, 4.0]) == pytest.approx((3.25 - 1.75) / 2.5)
    assert _spread([QUIET, QUIET, QUIET, SLOW, SLOW]) == pytest.approx(2.0)
    assert _spread([5.0]) == _spread([]) == _spread([0.0, 0.0]) == 0.0
    samples = _Samples(
        forward={"a": [1.0, 2.0, 3.0, 4.0], "b": [2.0, 2.0, 2.0, 2.0]},
        backward={"a": _Alone(0.0, [4.0, 4.0, 6.0, 6.0], "input")},
        whole=([3.0, 4.0, 5.0, 6.0], [4.0, 4.0, 4.0, 4.0]),
    )
    summary = _summarize(samples)
    assert summary.spread["a"] == pytest.approx([0.6, 0.4, 0.4, 0.0])  # I is a's backward
    assert summary.spread["b"] == [0.0, 0.0, 0.0, 0.0]
    assert summary.spread["(whole graph)"] == pytest.approx([1.5 / 4.5, 0.0])
    assert summary.rounds == {"a": [1] * 4, "b": [1] * 4, "(whole graph)": [1, 1]}
    assert summary.whole == (4.5, 4.0) and summary.scale == 4.0 / 5.0


def test_noisy_times_are_measured_again(tmp_path, monkeypatch) -> None:
    gm, inputs = mlp()
    rounds = scripted_timer(monkeypatch, noisy_rounds={1})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsettledProfileWarning)
        profile(gm, inputs, tmp_path)
    settings = gm.meta[PROFILE]
    assert rounds[0] == 2 and settings.noisy == () and settings.unsettled == ()
    assert all(n.meta[MEASURED_SPREAD] == (0.0, 0.0) for n in gm.graph.nodes)
    (cache_file,) = tmp_path.glob("profile-*.json")
    doc = json.loads(cache_file.read_text())
    assert doc["format"] == profile_cache.CACHE_FORMAT == 4
    assert doc["rounds"]["(whole graph)"] == [2, 1]  # every forward measured twice
    assert all(r == [2, 1, 1, 1] for n, r in doc["rounds"].items() if n != "(whole graph)")


def test_times_still_noisy_are_used_listed_and_cached(tmp_path, monkeypatch, capsys) -> None:
    gm, inputs = mlp()
    rounds = scripted_timer(monkeypatch, noisy_rounds=set(range(1, 100)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsettledProfileWarning)  # noisy is not unsettled
        profile(gm, inputs, tmp_path)
    settings = gm.meta[PROFILE]
    assert rounds[0] == 1 + profile_pass.EXTRA_ROUNDS and settings.cache_path
    compute = [n.name for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    # every node's forward, and the whole graph's (the sum of theirs per run)
    whole = ("(whole graph)", "forward", len(compute) * QUIET, 2.0, 3)
    assert settings.noisy[0] == pytest.approx(whole)
    assert {(name, d) for name, d, *_ in settings.noisy[1:]} == {(n, "forward") for n in compute}
    assert all(noisy[2:] == (QUIET, 2.0, 3) for noisy in settings.noisy[1:])
    assert gm.graph.find_nodes(op="call_module")[0].meta[MEASURED_SPREAD] == (2.0, 0.0)

    profile(gm, inputs, tmp_path)  # from the cache: the same spreads, rounds and list
    assert rounds[0] == 3 and gm.meta[PROFILE].cached
    assert gm.meta[PROFILE].noisy == settings.noisy

    # analyze's 10 repeats: the CostGraph carries the spreads, its meta the list
    costs = pdcompile.analyze(gm, tuple(inputs.values()), cache=tmp_path, progress=False,
                              calibration=False)  # fmt: skip
    node = costs.graph.nodes[compute[0]]
    assert (node["forward_spread"], node["backward_spread"]) == (2.0, 0.0)
    assert costs.meta["profile"]["noisy"][0][3] == 2.0

    monkeypatch.setenv("PDCOMPILE_CACHE_DIR", str(tmp_path))
    assert main(["profile", "pdcompile.zoo:mlp", "--calibration", "off", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "noisy times" in out and "spread" in out and "rounds" in out
    row = next(line for line in out.splitlines() if f" {compute[0]} " in line and "2.00" in line)
    assert "forward" in row and "1.00 ms" in row and row.rstrip(" │").endswith("3")


def test_a_cache_of_the_format_before_spreads_is_measured_again(tmp_path, monkeypatch,
                                                                caplog) -> None:  # fmt: skip
    gm, inputs = mlp()
    rounds = scripted_timer(monkeypatch, noisy_rounds=set())
    profile(gm, inputs, tmp_path)
    (cache_file,) = tmp_path.glob("profile-*.json")
    doc = json.loads(cache_file.read_text())
    old = {k: v for k, v in doc.items() if k not in ("spread", "rounds", "whole_s",
                                                     "backward_scale")}  # fmt: skip
    cache_file.write_text(json.dumps({**old, "format": 3}))
    with caplog.at_level(logging.INFO, logger=profile_cache.__name__):
        profile(gm, inputs, tmp_path)
    assert rounds[0] == 2 and not gm.meta[PROFILE].cached
    assert any("predates format 4" in r.getMessage() for r in caplog.records)
    assert json.loads(cache_file.read_text())["format"] == 4


def test_the_whole_graph_times_and_backward_scale_round_trip(tmp_path, monkeypatch) -> None:
    gm, inputs = mlp()
    scripted_timer(monkeypatch, noisy_rounds=set())
    profile(gm, inputs, tmp_path)
    measured = gm.meta[PROFILE]
    profile(gm, inputs, tmp_path)
    cached = gm.meta[PROFILE]
    assert cached.cached and (cached.whole_s, cached.backward_scale, cached.noisy) == (
        measured.whole_s,
        measured.backward_scale,
        measured.noisy,
    )
    compute = sum(n.op in COMPUTE_OPS for n in gm.graph.nodes)
    assert cached.whole_s == (math.fsum([QUIET] * compute), QUIET)
