"""The profile cache: provenance of cached times, and unsettled measurements kept out of it.

The timer is scripted (every timed call returns 1 ms, or 40 ms when "slow"), so these tests are
deterministic and fast on a busy machine; the graph still runs for real.
"""

from __future__ import annotations

import itertools
import json
import logging
import warnings
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest
from support import example

import pdcompile
from pdcompile.compiling.analysis import graph_inputs
from pdcompile.core.errors import UnsettledProfileWarning
from pdcompile.core.ir import MEASURED_S, PROFILE
from pdcompile.passes import profile as profile_pass
from pdcompile.passes import profile_cache
from pdcompile.passes.profile import annotate_profile

QUIET, SLOW = 1e-3, 40e-3


def mlp():
    model, args, kwargs = example("mlp")
    gm = pdcompile.trace(model, args, example_kwargs=kwargs)
    return gm, graph_inputs(gm, args, kwargs)


def scripted_timer(monkeypatch, noisy_rounds: set[int], only: str = "") -> list[int]:
    """Replace the timer. In a noisy round three timed calls in four (of functions whose
    qualified name contains `only`) are slow: a time's four repeats then have a slow median and
    a quiet fastest. Returns the round counter."""
    rounds = [0]

    def timer_for(device):
        rounds[0] += 1
        calls = itertools.count()
        noisy = rounds[0] in noisy_rounds

        def timer(fn):
            fn()
            if noisy and only in fn.__qualname__:
                return SLOW if next(calls) % 4 else QUIET
            return QUIET

        return timer

    monkeypatch.setattr(profile_pass, "device_timer", timer_for)
    return rounds


def profile(gm, inputs, cache, progress=False):
    return annotate_profile(gm, inputs, warmup=1, repeats=4, cache=cache, progress=progress)


def test_a_cached_profile_says_which_file_and_how_old(tmp_path, monkeypatch, capsys, caplog):
    gm, inputs = mlp()
    scripted_timer(monkeypatch, noisy_rounds=set())
    profile(gm, inputs, tmp_path)
    (cache_file,) = tmp_path.glob("profile-*.json")
    measured = gm.meta[PROFILE]
    assert not measured.cached and measured.cache_path == str(cache_file)
    assert measured.origin() == f"profile measured in this run, cached in {cache_file}"

    three_hours_ago = datetime.now(timezone.utc) - timedelta(hours=3, minutes=1)
    doc = json.loads(cache_file.read_text())
    doc["measured_at"] = three_hours_ago.isoformat(timespec="seconds")
    cache_file.write_text(json.dumps(doc))
    with caplog.at_level(logging.INFO, logger=profile_pass.__name__):
        profile(gm, inputs, tmp_path, progress=True)
    cached = gm.meta[PROFILE]
    assert cached.cached and cached.cache_path == str(cache_file)
    assert cached.measured_at == doc["measured_at"]
    line = f"profile from cache {cache_file}, measured 3 h ago"
    assert cached.origin() == line
    assert line in capsys.readouterr().err  # the console line, shown with progress
    assert any(line in r.getMessage() for r in caplog.records)


def test_scattered_times_are_measured_again_and_cached_once_settled(tmp_path, monkeypatch):
    gm, inputs = mlp()
    rounds = scripted_timer(monkeypatch, noisy_rounds={1})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsettledProfileWarning)
        profile(gm, inputs, tmp_path)
    assert rounds[0] == 2 and all(n.meta[MEASURED_S][0] in (0.0, QUIET) for n in gm.graph.nodes)
    assert gm.meta[PROFILE].unsettled == () and len(list(tmp_path.glob("profile-*.json"))) == 1
    profile(gm, inputs, tmp_path)
    assert rounds[0] == 2 and gm.meta[PROFILE].cached


def test_a_scattered_backward_alone_is_measured_again(tmp_path, monkeypatch):
    gm, inputs = mlp()
    monkeypatch.setattr(profile_pass, "MIN_SHARE", 0.0)  # judge every time, however small
    rounds = scripted_timer(monkeypatch, noisy_rounds={1}, only="_isolated_backward")
    profile(gm, inputs, tmp_path)
    # the second round's quiet repeats replaced the first's (which would leave 39 ms alone)
    assert rounds[0] == 2 and all(n.meta[MEASURED_S][1] == 0.0 for n in gm.graph.nodes)
    assert gm.meta[PROFILE].unsettled == () and gm.meta[PROFILE].cache_path


def test_times_still_scattered_are_flagged_and_never_served_from_the_cache(tmp_path, monkeypatch):
    gm, inputs = mlp()
    rounds = scripted_timer(monkeypatch, noisy_rounds={1, 2, 3})
    with pytest.warns(UnsettledProfileWarning, match="after 3 rounds of 4 repeats") as caught:
        profile(gm, inputs, tmp_path)
    assert rounds[0] == 1 + profile_pass.EXTRA_ROUNDS
    settings = gm.meta[PROFILE]
    message, (name, direction, slowdown) = str(caught[0].message), settings.unsettled[0]
    assert slowdown == SLOW / QUIET  # a slow median, a quiet fastest repeat
    assert f"{name} {direction} (40 ms median, 40.0x its fastest repeat)" in message
    assert "idle machine" in message and "raise repeats" in message
    assert not settings.cached and settings.cache_path is None
    assert "unsettled, not cached" in settings.origin()
    assert list(tmp_path.glob("profile-*.json")) == []

    profile(gm, inputs, tmp_path)  # the next run measures again (the machine is quiet now)
    assert rounds[0] == 4 and not gm.meta[PROFILE].cached and gm.meta[PROFILE].unsettled == ()


def test_a_settled_profile_round_trips_through_the_cache_unchanged(tmp_path, monkeypatch):
    gm, inputs = mlp()
    rounds = scripted_timer(monkeypatch, noisy_rounds=set())
    profile(gm, inputs, tmp_path)
    measured, settings = {n.name: n.meta[MEASURED_S] for n in gm.graph.nodes}, gm.meta[PROFILE]
    (cache_file,) = tmp_path.glob("profile-*.json")
    doc = json.loads(cache_file.read_text())
    assert doc["format"] == profile_cache.CACHE_FORMAT
    assert doc["measured_at"] == settings.measured_at
    assert set(doc["slowdown"]) == set(doc["nodes"]) | {"(whole graph)"}

    profile(gm, inputs, tmp_path)
    assert rounds[0] == 1 and {n.name: n.meta[MEASURED_S] for n in gm.graph.nodes} == measured
    assert gm.meta[PROFILE] == replace(settings, cached=True)
    key = profile_cache.cache_key(gm, inputs, settings)  # provenance is not part of the key
    assert key == profile_cache.cache_key(gm, inputs, gm.meta[PROFILE])
    assert cache_file.name == f"profile-{key[:24]}.json"


def test_old_flagged_and_damaged_cache_files_are_measured_again(tmp_path, monkeypatch, caplog):
    gm, inputs = mlp()
    rounds = scripted_timer(monkeypatch, noisy_rounds=set())
    profile(gm, inputs, tmp_path)
    (cache_file,) = tmp_path.glob("profile-*.json")
    new = json.loads(cache_file.read_text())
    stale = {name: [58.9e-3, 58.9e-3] for name in new["nodes"]}  # measured on a busy machine
    old = {"key": new["key"], "settings": new["settings"], "nodes": stale}  # before format 2
    flagged = {**new, "nodes": stale, "slowdown": {n: [45.3, 1.0] for n in new["nodes"]}}
    damaged = {k: v for k, v in new.items() if k != "slowdown"}
    for doc, said in [(old, "predates"), (flagged, "unsettled"), (damaged, "unreadable")]:
        cache_file.write_text(json.dumps(doc))
        before = rounds[0]
        with caplog.at_level(logging.INFO, logger=profile_cache.__name__):
            profile(gm, inputs, tmp_path)
        assert rounds[0] == before + 1 and not gm.meta[PROFILE].cached
        assert any(said in r.getMessage() for r in caplog.records), said
        assert all(n.meta[MEASURED_S][0] != 58.9e-3 for n in gm.graph.nodes)
        assert json.loads(cache_file.read_text())["format"] == profile_cache.CACHE_FORMAT
        caplog.clear()


def test_the_cost_graph_records_where_its_times_came_from(tmp_path, monkeypatch):
    model, args, kwargs = example("mlp")
    gm = pdcompile.trace(model, args, example_kwargs=kwargs)
    scripted_timer(monkeypatch, noisy_rounds=set())
    analyze = dict(example_kwargs=kwargs, cache=tmp_path, progress=False, rows=())
    first = pdcompile.analyze(gm, args, **analyze)
    (cache_file,) = tmp_path.glob("profile-*.json")  # the example's rows alone: rows=()
    recorded = first.meta["profile"]
    assert recorded["cache_path"] == str(cache_file) and not recorded["cached"]
    assert recorded["measured_at"] and recorded["unsettled"] == []
    second = pdcompile.analyze(gm, args, **analyze)
    assert second.meta["profile"] == {**recorded, "cached": True}
    assert pdcompile.CostGraph.from_json(second.to_json()) == second
    assert pdcompile.analyze(gm, args, profile=False, **analyze).meta["profile"] is None
