"""Every loader either loads or raises a `PdcompileError`: fuzzed with hypothesis.

Valid files of each kind (a Plan, a CostGraph, a PipeDream profile, a checkpoint manifest) get
random byte damage (flips, truncation, insertions, random bytes) and random edits of their JSON
(deleted keys, changed types, negative, huge, NaN and infinite numbers, nested garbage) or of
their lines. A loader that raises anything else (KeyError, TypeError, OverflowError,
RecursionError, ...) fails the test; pytest-timeout ends a hang.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdcompile
from pdcompile.cluster import Cluster
from pdcompile.cost_graph import CostGraph
from pdcompile.errors import PdcompileError
from pdcompile.plans import Plan
from pdcompile.runtime import checkpoint
from pdcompile.zoo import MLP

DATA = Path(__file__).parent / "data" / "pipedream"
PROFILE = (DATA / "gnmt" / "graph.txt").read_text()  # lists of activation sizes, 3 inputs
COSTS = CostGraph.from_pipedream(DATA / "gnmt" / "graph.txt", batch_size=64)
PLAN = pdcompile.plan(COSTS, Cluster.parse("2@300GB/s,2", memory="80GB"), solver="dp")
FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI failures reproduce
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

NUMBERS = st.sampled_from(
    [-1, 0, -0.5, 1.5, 2**63, 10**400, -(10**400), math.nan, math.inf, -math.inf, True]
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6) | NUMBERS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


# damage --------------------------------------------------------------------------------------


@st.composite
def damaged_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` with flipped bytes, a truncation, inserted bytes, or replaced by random bytes."""
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "random"]))
    rng = draw(st.randoms(use_true_random=False))  # positions uniform over the file
    out = bytearray(data)
    if kind == "random":
        return draw(st.binary(max_size=512))
    if kind == "truncate":
        return bytes(out[: rng.randrange(len(out))])
    for _ in range(draw(st.integers(1, 4))):
        at = rng.randrange(len(out))
        if kind == "flip":
            out[at] ^= 1 << draw(st.integers(0, 7))
        else:
            out[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(out)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON document: keys and indices from the root."""
    found = [prefix]
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, child in items:
        found += _paths(child, (*prefix, key))
    return found


@st.composite
def edited_json(draw: st.DrawFn, doc: Any) -> str:
    """`doc` after 1-3 random edits, as JSON text (NaN and Infinity allowed, as Python writes)."""
    doc = json.loads(json.dumps(doc))
    rng = draw(st.randoms(use_true_random=False))  # places uniform over the document
    for _ in range(draw(st.integers(1, 3))):
        path = rng.choice(_paths(doc))
        parent, key = doc, None
        for step in path:
            parent, key = (parent[key] if key is not None else parent), step
        value = doc if key is None else parent[key]
        edit = draw(st.sampled_from(["delete", "replace", "number", "negate", "wrap", "text"]))
        if edit == "delete" and key is not None:
            del parent[key]
            continue
        if edit == "replace" or edit == "delete":
            new = draw(JSON)
        elif edit == "number":
            new = draw(NUMBERS)
        elif edit == "negate":
            new = -value if isinstance(value, (int, float)) else draw(NUMBERS)
        elif edit == "wrap":
            new = draw(st.sampled_from([[value], {"value": value}, [[value, value]]]))
        else:
            new = json.dumps(value)
        if key is None:
            doc = new
        else:
            parent[key] = new
    return json.dumps(doc)


@st.composite
def edited_lines(draw: st.DrawFn, text: str) -> str:
    """PipeDream text after 1-3 line edits: deleted, duplicated or cut lines, numbers replaced."""
    lines = text.split("\n")
    rng = draw(st.randoms(use_true_random=False))  # lines uniform over the file
    for _ in range(draw(st.integers(1, 3))):
        at = rng.randrange(len(lines))
        edit = draw(st.sampled_from(["delete", "duplicate", "cut", "number", "garbage"]))
        if edit == "delete":
            del lines[at]
        elif edit == "duplicate":
            lines.insert(at, lines[at])
        elif edit == "cut":
            lines[at] = lines[at][: rng.randint(0, len(lines[at]))]
        elif edit == "number":
            number = draw(st.sampled_from(["-1", "1e999", "nan", "inf", "1" * 400, "0x1", ""]))
            head, sep, tail = lines[at].partition("=")
            lines[at] = head + sep + number + tail.lstrip("0123456789.")
        else:
            lines[at] = draw(st.text(max_size=40))
        if not lines:
            lines = [""]
    return "\n".join(lines)


def loads_or_refuses(load: Callable[[], Any], where: Path, use: Callable[[Any], Any]) -> None:
    """`load()` returns something `use` can handle, or raises a PdcompileError naming `where`."""
    try:
        loaded = load()
    except PdcompileError as exc:
        assert str(where) in str(exc), exc
        return
    use(loaded)


# the loaders ----------------------------------------------------------------------------------


def json_files(text: str) -> st.SearchStrategy[bytes]:
    """Damaged bytes of `text`, or its JSON edited."""
    return damaged_bytes(text.encode()) | edited_json(json.loads(text)).map(str.encode)


@pytest.mark.timeout(120)
@FUZZ
@given(json_files(PLAN.to_json()))
def test_plan_loader(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        path.write_bytes(data)
        loads_or_refuses(lambda: Plan.load(path), path, lambda plan: (str(plan), plan.to_json()))


@pytest.mark.timeout(120)
@FUZZ
@given(json_files(COSTS.to_json()))
def test_cost_graph_loader(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "costs.json"
        path.write_bytes(data)
        loads_or_refuses(lambda: CostGraph.load(path), path, lambda g: (str(g), g.to_json()))


@pytest.mark.timeout(120)
@FUZZ
@given(damaged_bytes(PROFILE.encode()) | edited_lines(PROFILE).map(str.encode))
def test_pipedream_loader(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.txt"
        path.write_bytes(data)
        load = lambda: CostGraph.from_pipedream(path, batch_size=64)  # noqa: E731
        loads_or_refuses(load, path, lambda g: (str(g), g.to_json()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("fuzz") / "ckpt"
    module = MLP(p=0.0)
    adam = torch.optim.Adam(module.parameters())
    checkpoint.save(directory, model=module, optimizer=adam, extra={"steps": 3}, step=3)
    return directory


@pytest.mark.timeout(120)
@FUZZ
@given(data=st.data())
def test_checkpoint_manifest_loader(saved: Path, data: st.DataObject) -> None:
    manifest = (saved / "manifest.json").read_text()
    damaged = data.draw(json_files(manifest))
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "ckpt"
        shutil.copytree(saved, copy)
        (copy / "manifest.json").write_bytes(damaged)
        loads_or_refuses(lambda: checkpoint.load_full_state_dict(copy), copy, len)


LOADERS = {
    "plan": lambda path: Plan.load(path),
    "cost graph": lambda path: CostGraph.load(path),
    "manifest": lambda path: checkpoint.load_full_state_dict(path.parent),
}


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_json_nested_past_the_recursion_limit_is_refused(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PdcompileError, match=str(tmp_path)):
        LOADERS[kind](path)
    with pytest.raises(PdcompileError, match="cluster JSON is not valid"):
        Cluster.from_json("[" * 100_000)
