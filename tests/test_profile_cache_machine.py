"""The profile cache (issue 31): its key names the machine (a folder shared between machines
serves no one's times to another), and a file holding NaN or negative times is ignored with a
warning naming it, then measured again, never a fatal CostError."""

from __future__ import annotations

import json
import logging

from support import example
from test_profile_cache import mlp, profile, scripted_timer

import pdcompile
from pdcompile.passes import profile_cache
from pdcompile.passes.profile import ProfileSettings


def test_the_key_names_the_host_and_the_cpu(monkeypatch) -> None:
    gm, inputs = mlp()
    settings = ProfileSettings(device="cpu", num_threads=1, warmup=1, repeats=4,
                               torch_version="x")  # fmt: skip
    here = profile_cache.cache_key(gm, inputs, settings)
    monkeypatch.setattr(profile_cache.platform, "node", lambda: "another-host")
    elsewhere = profile_cache.cache_key(gm, inputs, settings)
    monkeypatch.setattr(profile_cache, "_cpu_model", lambda: "another CPU")
    assert len({here, elsewhere, profile_cache.cache_key(gm, inputs, settings)}) == 3


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_cache_file_with_nan_or_negative_times_is_ignored_and_replaced(
    tmp_path, monkeypatch
) -> None:
    model, args, kwargs = example("mlp")
    gm = pdcompile.trace(model, args, example_kwargs=kwargs)
    scripted_timer(monkeypatch, noisy_rounds=set())
    options = dict(example_kwargs=kwargs, cache=tmp_path, progress=False, rows=())
    pdcompile.analyze(gm, args, **options)
    (path,) = tmp_path.glob("profile-*.json")
    good = json.loads(path.read_text())
    node = next(iter(good["nodes"]))
    for bad in (float("nan"), -1.0):
        doc = json.loads(path.read_text())
        doc["nodes"][node][0] = bad
        path.write_text(json.dumps(doc))
        records, logger = _Records(), logging.getLogger(profile_cache.__name__)
        logger.addHandler(records)
        try:
            costs = pdcompile.analyze(gm, args, **options)
        finally:
            logger.removeHandler(records)
        warned = f"ignoring profile cache {path}: node {node}'s time is {bad!r}"
        assert any(warned in m for m in records.messages), records.messages
        assert not costs.meta["profile"]["cached"]
        assert json.loads(path.read_text())["nodes"][node] == good["nodes"][node]
    gm2, inputs = mlp()
    profile(gm2, inputs, tmp_path)  # the replaced file serves again
