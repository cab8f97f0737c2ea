"""Every loader either loads or raises a `PdcompileError`: fuzzed with hypothesis.

Valid files of each kind (a Plan, a CostGraph, a PipeDream profile, a checkpoint manifest, a
cluster's text and JSON) get random byte damage (flips, truncation, insertions, random bytes)
and random edits of their JSON (deleted keys, changed types, negative, huge (1e308, 2**64,
10**400), NaN and infinite numbers, huge counts, garbage nested up to 100000 deep) or of their
lines. A loader that raises anything else (KeyError, TypeError, OverflowError, RecursionError,
...) fails the test, and so does a loaded plan whose simulation is not a finite step with
bubbles between 0 and 1; pytest-timeout ends a hang. The commands that read files (`graph`,
`plan`, `simulate`) get the same files: they succeed, or fail with one line on standard error.
"""

from __future__ import annotations

import contextlib
import io
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
from pdcompile.cli.handlers import main
from pdcompile.core.cluster import Cluster
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PdcompileError
from pdcompile.passes.planning.plans import Plan
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
    [-1, 0, -0.5, 1.5, 2**63, 2**64, 10**400, -(10**400), 1e308, -1e308, 1e300, math.nan,
     math.inf, -math.inf, True, 10**9, 99_999_999_999, 2**53 + 1]
)  # fmt: skip
DEPTHS = st.sampled_from([2, 50, 900, 5_000, 100_000])  # nested lists around a value
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
        edit = draw(
            st.sampled_from(["delete", "replace", "number", "negate", "wrap", "nest", "text"])
        )
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
        elif edit == "nest":  # written as text below: json.dumps recurses
            new = _NESTED
        else:
            new = json.dumps(value)
        if key is None:
            doc = new
        else:
            parent[key] = new
    text = json.dumps(doc)
    depth = draw(DEPTHS)
    return text.replace(json.dumps(_NESTED), "[" * depth + "1" + "]" * depth)


_NESTED = "<nested>"  # stands for a value nested deeply in lists


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
            number = draw(st.sampled_from(["-1", "1e999", "nan", "inf", "1" * 400, "0x1", "",
                                           "1e308", "1e300", "18446744073709551616"]))  # fmt: skip
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


def simulates(plan: Plan) -> None:
    """A loaded plan prints, writes itself again and simulates to a finite step with bubbles
    between 0 and 1, or its simulation refuses it (a schedule it cannot run, a budget)."""
    str(plan), plan.to_json()
    try:
        sim = pdcompile.simulate(plan)
    except PdcompileError:
        return
    assert math.isfinite(sim.time_per_step) and sim.time_per_step >= 0, sim.time_per_step
    assert all(0 <= b <= 1 for b in sim.bubble_fraction), sim.bubble_fraction


@pytest.mark.timeout(300)
@FUZZ
@given(json_files(PLAN.to_json()))
def test_plan_loader(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        path.write_bytes(data)
        loads_or_refuses(lambda: Plan.load(path), path, simulates)


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


CLUSTER_TEXTS = st.sampled_from(
    ["4", "8@300GB/s,16@25Gbit/s+5us", "2@1GB/s+1ms", "99999999999", "1000000", "2@", "2@+",
     "2@+5us", "2@1e308B/s", "2@1e999GB/s", "2@nanGB/s", "2@-1GB/s", "0", "1024,1024", "2+inf s",
     "18446744073709551616", "2@1GB/s+1e308s", ",", "4@@1GB/s"]
)  # fmt: skip


@st.composite
def cluster_texts(draw: st.DrawFn) -> str:
    """A cluster spelling, possibly with characters damaged, dropped or inserted."""
    text = draw(CLUSTER_TEXTS)
    if draw(st.booleans()):
        return text
    return draw(damaged_bytes(text.encode())).decode("latin-1")


@FUZZ
@given(cluster_texts(), st.sampled_from([None, "80GB", "1e400GB", "0B", "-1GB", "nan", "2**64"]))
def test_cluster_text_loader(text: str, memory: str | None) -> None:
    try:
        cluster = Cluster.parse(text, memory=memory)
    except PdcompileError:
        return
    assert 1 <= cluster.num_devices <= 2**17
    assert Cluster.parse(str(cluster), memory=cluster.memory) == cluster  # str parses back
    assert Cluster.from_json(cluster.to_json()) == cluster


@FUZZ
@given(json_files(Cluster.parse("8@300GB/s,2@25Gbit/s+5us", memory="80GB").to_json()))
def test_cluster_json_loader(data: bytes) -> None:
    try:
        cluster = Cluster.from_json(data.decode("latin-1"))
    except PdcompileError:
        return
    assert 1 <= cluster.num_devices <= 2**17 and Cluster.from_json(cluster.to_json()) == cluster


def one_line_or_success(*argv: object) -> None:
    """`pdcompile ARGV` succeeds, or fails with one line on standard error (no traceback)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    if code:
        text = err.getvalue()
        assert code in (1, 2) and text.startswith("pdcompile: error: "), text
        assert text.count("\n") == 1, text


CLI = settings(FUZZ, max_examples=40)  # a command reads, plans and simulates: fewer examples


@pytest.mark.timeout(600)
@CLI
@given(json_files(COSTS.to_json()) | damaged_bytes(PROFILE.encode()) | json_files(PLAN.to_json()))
def test_commands_reading_files(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("input.json", "graph.txt"):
            path = Path(tmp) / name
            path.write_bytes(data)
            one_line_or_success("graph", path)
            one_line_or_success("plan", path, "--cluster", "2")
            one_line_or_success("simulate", path, "--cluster", "2")
            one_line_or_success("simulate", path)


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
