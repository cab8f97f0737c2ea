"""CostGraph: attributes, validation, scaling, JSON round trips, PipeDream import and export."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile import CostError, CostGraph
from pdcompile.core.cost_graph import KINDS, NODE_ATTRS

DATA = Path(__file__).parent / "data" / "pipedream"
MODELS = ("vgg16", "resnet50", "gnmt")


def small() -> CostGraph:
    g = CostGraph(batch_size=4, meta={"source": "test"})
    g.add_node("x", kind="input", output_bytes=64)
    g.add_node("fc", forward_s=1e-3, backward_s=2e-3, param_bytes=400, grad_bytes=400)
    g.add_node("loss", kind="output", activation_bytes=8, output_bytes=4, scope="head")
    g.add_edge("x", "fc", 64)
    g.add_edge("fc", "loss", bytes=32)
    return g


# -- building and validation ---------------------------------------------------------------


def test_defaults_and_derived_memory() -> None:
    g = CostGraph()
    g.add_node("a", param_bytes=10, grad_bytes=10, optimizer_bytes=20, activation_bytes=5)
    data = g.graph.nodes["a"]
    assert set(data) == set(NODE_ATTRS)
    assert data["memory_bytes"] == 45 and data["kind"] == "compute"
    assert data["members"] == ("a",) and data["activation_sizes"] is None
    assert data["forward_s"] == 0.0 and isinstance(data["forward_s"], float)
    assert g.nodes == ["a"] and g.batch_size is None and g.meta == {}


@pytest.mark.parametrize(
    ("attrs", "fragment"),
    [
        ({"speed": 1.0}, "unknown attribute 'speed'"),
        ({"memory_bytes": 3}, "memory_bytes is derived"),
        ({"forward_s": -1.0}, "'forward_s' must be a finite number >= 0"),
        ({"forward_s": math.nan}, "'forward_s' must be"),
        ({"forward_s": "1"}, "'forward_s' must be"),
        ({"param_bytes": 1.5}, "'param_bytes' must be a whole number"),
        ({"param_bytes": True}, "'param_bytes' must be"),
        ({"kind": "loss"}, "'kind' must be one of input, compute, output"),
        ({"members": ()}, "'members' must be a non-empty tuple"),
        ({"activation_sizes": [1, -2]}, "'activation_sizes' must be None or a tuple"),
        ({"scope": None}, "'scope' must be a string"),
    ],
)
def test_add_node_rejects_bad_attributes(attrs: dict, fragment: str) -> None:
    with pytest.raises(CostError, match="node 'a'") as info:
        CostGraph().add_node("a", **attrs)
    assert fragment in str(info.value)


def test_add_edge_checks_endpoints_order_and_duplicates() -> None:
    g = small()
    with pytest.raises(CostError, match="node 'nope' is not in the CostGraph"):
        g.add_edge("x", "nope", 1)
    with pytest.raises(CostError, match="goes backwards in the node order.*topological"):
        g.add_edge("loss", "x", 1)
    with pytest.raises(CostError, match="already exists"):
        g.add_edge("x", "fc", 1)
    with pytest.raises(CostError, match="'bytes' must be a whole number"):
        g.add_edge("x", "loss", -1)
    with pytest.raises(CostError, match="already in the CostGraph"):
        g.add_node("fc")


def test_constructor_copies_a_networkx_graph_and_checks_its_order() -> None:
    dag = nx.DiGraph()
    dag.add_node("a", forward_s=1.0)
    dag.add_node("b", param_bytes=8)
    dag.add_edge("a", "b", bytes=4)
    g = CostGraph(dag, batch_size=2, meta={"source": "test"})
    assert g.graph.nodes["b"]["memory_bytes"] == 8 and g.graph.edges["a", "b"]["bytes"] == 4
    assert CostGraph(g.graph, 2, g.meta) == g == g.copy()
    backwards = nx.DiGraph()
    backwards.add_nodes_from(["b", "a"])
    backwards.add_edge("a", "b", bytes=1)
    with pytest.raises(CostError, match="'a' -> 'b' goes backwards"):
        CostGraph(backwards)
    with pytest.raises(CostError, match="meta must be JSON-serializable"):
        CostGraph(meta={"x": object()})
    with pytest.raises(CostError, match="batch_size must be None or an integer >= 1"):
        CostGraph(batch_size=0)


def test_validate_catches_direct_edits() -> None:
    small().validate()
    g = small()
    g.graph.nodes["fc"]["param_bytes"] = 1
    with pytest.raises(CostError, match="node 'fc': memory_bytes is 800"):
        g.validate()
    g = small()
    g.graph.nodes["fc"]["forward_s"] = 1
    with pytest.raises(CostError, match="node 'fc': attribute 'forward_s' is 1 of type int"):
        g.validate()
    g = small()
    g.graph.add_edge("loss", "x", bytes=1)
    with pytest.raises(CostError, match="cycle"):
        g.validate()
    g = small()
    del g.graph.nodes["x"]["scope"]
    with pytest.raises(CostError, match=r"node 'x': missing attributes \['scope'\]"):
        g.validate()


def test_totals_use_fsum() -> None:
    g = CostGraph()
    for i, t in enumerate([1e16, 1.0, -0.0, 1.0]):
        g.add_node(f"n{i}", forward_s=abs(t), param_bytes=i)
    totals = g.totals()
    assert totals["forward_s"] == math.fsum([1e16, 1.0, 1.0]) == 1e16 + 2
    assert totals["param_bytes"] == 6 and totals["memory_bytes"] == 6
    assert {"backward_s", "output_bytes", "flops_forward", "flops_backward"} <= set(totals)


def test_str_is_a_readable_summary() -> None:
    text = str(small())
    assert "3 nodes, 2 edges, batch size 4" in text and "(test)" in text
    assert "forward 1.00 ms" in text and "parameters 400 B" in text
    assert repr(small()) == "<CostGraph 3 nodes, 2 edges, batch_size=4>"


def test_equality_looks_at_everything() -> None:
    assert small() == small()
    other = small()
    other.meta["source"] = "other"
    assert other != small()
    other = small()
    other.batch_size = 8
    assert other != small()
    other = small()
    other.graph.edges["x", "fc"]["bytes"] = 1
    assert other != small()
    assert small() != "graph"


# -- scaling -------------------------------------------------------------------------------


def test_scaled_scales_times_and_activations_not_parameters() -> None:
    g = CostGraph(batch_size=4)
    g.add_node("a", forward_s=1.0, backward_s=3.0, flops_forward=8.0, output_bytes=10)
    g.add_node(
        "b",
        param_bytes=100,
        grad_bytes=100,
        optimizer_bytes=200,
        activation_bytes=41,
        output_bytes=6,
        activation_sizes=(2, 4.0),
    )
    g.add_edge("a", "b", 10)
    h = g.scaled(6)
    a, b = h.graph.nodes["a"], h.graph.nodes["b"]
    assert h.batch_size == 6 and h.meta == g.meta
    assert (a["forward_s"], a["backward_s"], a["flops_forward"]) == (1.5, 4.5, 12.0)
    assert (b["param_bytes"], b["grad_bytes"], b["optimizer_bytes"]) == (100, 100, 200)
    assert b["activation_bytes"] == 62 and b["output_bytes"] == 9  # 61.5 rounds half up
    assert b["activation_sizes"] == (3, 6.0) and isinstance(b["activation_sizes"][0], int)
    assert b["memory_bytes"] == 100 + 100 + 200 + 62
    assert h.graph.edges["a", "b"]["bytes"] == 15
    assert g.scaled(4) == g


def test_scaled_needs_a_batch_size() -> None:
    with pytest.raises(CostError, match="no batch_size.*from_pipedream"):
        CostGraph.from_pipedream(DATA / "vgg16" / "graph.txt").scaled(64)
    for bad in (0, -1, 2.5, None):
        with pytest.raises(CostError, match="batch_size"):
            small().scaled(bad)  # type: ignore[arg-type]


# -- JSON ----------------------------------------------------------------------------------

_numbers = st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False)
_sizes = st.integers(min_value=0, max_value=2**50)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | _numbers | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)


@st.composite
def cost_graphs(draw: st.DrawFn, max_nodes: int = 10) -> CostGraph:
    """Random DAG CostGraphs: random ids, every attribute drawn, edges only forwards."""
    ids = draw(
        st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=max_nodes, unique=True)
    )
    meta = draw(st.dictionaries(st.text(max_size=6), _json, max_size=4))
    g = CostGraph(batch_size=draw(st.none() | st.integers(1, 4096)), meta=meta)
    for node in ids:
        attrs = {name: draw(_numbers) for name in ("forward_s", "backward_s")}
        attrs.update({name: draw(_numbers) for name in ("flops_forward", "flops_backward")})
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"):
            attrs[name] = draw(_sizes)
        g.add_node(
            node,
            **attrs,
            output_bytes=draw(_sizes),
            kind=draw(st.sampled_from(KINDS)),
            description=draw(st.text(max_size=12)),
            scope=draw(st.sampled_from(["", "a", "a.b", "a.b.c", "d"])),
            members=tuple(draw(st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3))),
            activation_sizes=draw(st.none() | st.lists(_sizes | _numbers, max_size=3).map(tuple)),
        )
    pairs = draw(st.sets(st.tuples(st.integers(0, len(ids) - 1), st.integers(0, len(ids) - 1))))
    for i, j in sorted(pairs):
        if i < j:
            g.add_edge(ids[i], ids[j], draw(_sizes))
    return g


@settings(deadline=None, max_examples=50)
@given(cost_graphs())
def test_json_round_trip_is_exact(g: CostGraph) -> None:
    g.validate()
    text = g.to_json()
    back = CostGraph.from_json(text)
    assert back == g and back.to_json() == text
    assert back.nodes == g.nodes
    for node in g.nodes:  # exact floats, and the same types
        for name, value in g.graph.nodes[node].items():
            assert repr(back.graph.nodes[node][name]) == repr(value), (node, name)


def test_json_layout_and_file_round_trip(tmp_path: Path) -> None:
    g = small()
    doc = json.loads(g.to_json())
    assert (doc["format"], doc["version"], doc["batch_size"]) == ("pdcompile.costgraph", 4, 4)
    assert doc["nodes"][0]["id"] == "x" and doc["nodes"][0]["members"] == ["x"]
    assert doc["edges"][1] == {"src": "fc", "dst": "loss", "bytes": 32}
    assert len(g.to_json().splitlines()) == 12  # 3 nodes + 2 edges, one line each, + 7
    g.save(tmp_path / "g.json")
    assert CostGraph.load(tmp_path / "g.json") == g
    with pytest.raises(CostError, match="cannot read CostGraph file .*missing.json"):
        CostGraph.load(tmp_path / "missing.json")


def test_corrupt_or_truncated_json_names_path_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    text = small().to_json()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(CostError, match=rf"{re.escape(str(path))}:\d+:\d+: not valid JSON"):
        CostGraph.load(path)
    lines = text.splitlines()
    lines[4] = lines[4].replace('"kind"', "kind", 1)  # line 5: an unquoted key
    path.write_text("\n".join(lines))
    with pytest.raises(CostError, match=rf"costs.json:5:{lines[4].index('kind') + 1}: not valid"):
        CostGraph.load(path)


def _doc() -> dict:
    return json.loads(small().to_json())


def _error(doc: dict) -> str:
    with pytest.raises(CostError) as info:
        CostGraph.from_json(json.dumps(doc), source="g.json")
    return str(info.value)


def test_json_errors_name_the_node_edge_and_field() -> None:
    doc = _doc()
    del doc["nodes"][1]["forward_s"]
    assert "g.json: node #1 'fc': missing fields ['forward_s']" in _error(doc)
    doc = _doc()
    doc["nodes"][1]["param_bytes"] = "400"
    assert "g.json: node 'fc': attribute 'param_bytes' must be a whole number" in _error(doc)
    doc = _doc()
    doc["nodes"][1]["colour"] = "red"
    assert "unknown fields ['colour']" in _error(doc)
    doc = _doc()
    doc["nodes"][1]["memory_bytes"] = 1
    assert "node #1 'fc': field 'memory_bytes' is 1" in _error(doc)
    doc = _doc()
    del doc["edges"][0]["bytes"]
    assert "g.json: edge #0 must be an object with 'src', 'dst', 'bytes'" in _error(doc)
    doc = _doc()
    doc["edges"][0]["dst"] = "ghost"
    assert "node 'ghost' is not in the CostGraph" in _error(doc)
    doc = _doc()
    doc["format"] = "other"
    assert "not a CostGraph file" in _error(doc)
    doc = _doc()
    doc["version"] = 5
    assert "format version 5; this pdcompile reads versions 1, 2, 3 and 4" in _error(doc)
    doc = _doc()
    del doc["meta"]
    assert "missing ['meta']" in _error(doc)
    assert "not a CostGraph file" in _error([1, 2])  # type: ignore[arg-type]


# -- PipeDream -----------------------------------------------------------------------------

_NODE = re.compile(
    r"^(\S+) -- (.*) -- forward_compute_time=([\d.]+), backward_compute_time=([\d.]+), "
    r"activation_size=(\[[^\]]*\]|[\d.]+), parameter_size=([\d.]+)$"
)
_EDGE = re.compile(r"^\t(\S+) -- (\S+)$")


def reference_parse(path: Path) -> tuple[dict[str, tuple], list[tuple[str, str]]]:
    """An independent reading of a graph.txt: node -> raw fields, and the edges in file order."""
    nodes, edges = {}, []
    for line in path.read_text().splitlines():
        if m := _NODE.match(line):
            nodes[m.group(1)] = m.groups()[1:]
        else:
            edges.append(_EDGE.match(line).groups())  # type: ignore[union-attr]
    return nodes, edges


def activation_total(text: str) -> int:
    return round(math.fsum(float(x) for x in text.strip("[]").split(";")))


@pytest.mark.parametrize("model", MODELS)
def test_import_keeps_every_node_edge_and_number(model: str) -> None:
    path = DATA / model / "graph.txt"
    g = CostGraph.from_pipedream(path, batch_size=128)
    nodes, edges = reference_parse(path)
    assert len(g.nodes) == len(nodes) and set(g.nodes) == set(nodes)
    assert g.graph.number_of_edges() == len(edges) and set(g.graph.edges) == set(edges)
    assert g.batch_size == 128 and g.meta["source"] == "pipedream"
    for node, (desc, fwd, bwd, act, param) in nodes.items():
        d = g.graph.nodes[node]
        assert d["description"] == desc
        assert d["forward_s"] == float(fwd) / 1000 and d["backward_s"] == float(bwd) / 1000
        assert d["output_bytes"] == d["activation_bytes"] == activation_total(act)
        assert d["param_bytes"] == d["grad_bytes"] == round(float(param))  # all trained
        assert d["memory_bytes"] == 2 * d["param_bytes"] + d["activation_bytes"]
        assert d["kind"] == ("input" if desc.startswith("Input") else "compute")
        sizes = tuple(float(x) for x in act[1:-1].split(";")) if act.startswith("[") else None
        assert d["activation_sizes"] == sizes
    for u, v in edges:
        assert g.graph.edges[u, v]["bytes"] == activation_total(nodes[u][3])
    g.validate()


def test_input_nodes_and_multi_output_lists() -> None:
    kinds = {
        model: [
            n
            for n, k in CostGraph.from_pipedream(DATA / model / "graph.txt").graph.nodes(
                data="kind"
            )
            if k == "input"
        ]
        for model in MODELS
    }
    assert kinds == {"vgg16": ["node1"], "resnet50": ["node1"], "gnmt": ["node1", "node2", "node3"]}
    gnmt = CostGraph.from_pipedream(DATA / "gnmt" / "graph.txt")
    lstm = gnmt.graph.nodes["node23"]
    assert lstm["activation_sizes"] == (6160384.0, 131072.0, 131072.0, 6160384.0, 288768.0)
    assert lstm["output_bytes"] == lstm["activation_bytes"] == 12871680
    assert all(gnmt.graph.edges["node23", v]["bytes"] == 12871680 for v in gnmt.graph["node23"])
    assert gnmt.graph.nodes["node20"]["kind"] == "compute"  # a source that is not an Input


@pytest.mark.parametrize("model", MODELS)
def test_non_topological_files_are_reordered_and_the_file_order_kept(model: str) -> None:
    path = DATA / model / "graph.txt"
    g = CostGraph.from_pipedream(path)
    file_order = list(reference_parse(path)[0])
    assert g.nodes != file_order  # all three published files list nodes out of order
    assert g.nodes == list(nx.lexicographical_topological_sort(g.graph, key=file_order.index))
    assert g.meta["pipedream"]["node_order"] == file_order
    assert ("edge_order" in g.meta["pipedream"]) == (model == "gnmt")  # grouped by destination


@pytest.mark.parametrize("model", MODELS)
def test_export_reproduces_the_file_and_imports_equal(model: str, tmp_path: Path) -> None:
    path = DATA / model / "graph.txt"
    g = CostGraph.from_pipedream(path, batch_size=64)
    out = tmp_path / "graph.txt"
    g.to_pipedream(out)
    assert CostGraph.from_pipedream(out, batch_size=64) == g
    original, exported = path.read_text().splitlines(), out.read_text().splitlines()
    assert len(exported) == len(original)
    for old, new in zip(original, exported, strict=True):
        if _EDGE.match(old):
            assert new == old
            continue
        old_fields, new_fields = _NODE.match(old).groups(), _NODE.match(new).groups()  # type: ignore[union-attr]
        assert new_fields[:2] == old_fields[:2]
        for text, exact in zip(new_fields[2:4], old_fields[2:4], strict=True):
            assert text == repr(float(exact))  # the shortest text that reads back exactly
            assert float(text) / 1000 == float(exact) / 1000
        assert activation_total(new_fields[4]) == activation_total(old_fields[4])
        assert float(new_fields[5]) == float(old_fields[5])


def test_export_of_a_plain_graph_and_stage_ids(tmp_path: Path) -> None:
    g = small()
    g.graph.nodes["x"]["description"] = "Input0"
    g.to_pipedream(tmp_path / "graph.txt")
    back = CostGraph.from_pipedream(tmp_path / "graph.txt", batch_size=4)
    assert back.nodes == g.nodes and set(back.graph.edges) == set(g.graph.edges)
    assert back.graph.nodes["x"]["kind"] == "input"
    assert (
        back.graph.nodes["fc"]["forward_s"] == 1e-3 and back.graph.nodes["fc"]["param_bytes"] == 400
    )
    staged = tmp_path / "staged.txt"
    staged.write_text(
        "node1 -- Input -- forward_compute_time=1.0, backward_compute_time=0.0, "
        "activation_size=8.0, parameter_size=0.0 -- stage_id=0\n"
        "node2 -- a -- b -- forward_compute_time=0.25, backward_compute_time=0.5, "
        "activation_size=[4.0; 4.0], parameter_size=16.0 -- stage_id=1\n\tnode1 -- node2\n"
    )
    g = CostGraph.from_pipedream(staged)
    assert g.graph.nodes["node2"]["description"] == "a -- b"
    assert g.meta["pipedream"]["stage_ids"] == {"node1": 0, "node2": 1}
    g.to_pipedream(tmp_path / "again.txt")
    assert (tmp_path / "again.txt").read_text() == staged.read_text()
    g.graph.nodes["node2"]["description"] = "two\nlines"
    with pytest.raises(CostError, match="node 'node2': its description spans lines"):
        g.to_pipedream(tmp_path / "bad.txt")


_GOOD = (
    "node1 -- Input -- forward_compute_time=1.0, backward_compute_time=0.0, "
    "activation_size=8.0, parameter_size=0.0"
)


@pytest.mark.parametrize(
    ("lines", "fragment"),
    [
        ([_GOOD, "node2 -- ReLU -- forward_compute_time=x"], ":2: malformed node line"),
        ([_GOOD, _GOOD.replace("=1.0", "=-1.0")], ":2: negative time or size"),
        ([_GOOD, _GOOD], ":2: node 'node1' is already defined on line 1"),
        ([_GOOD, "\tnode1 node2"], ":2: malformed edge line"),
        ([_GOOD, "\tnode1 -- node9"], ":2: edge node1 -- node9 names node 'node9'"),
        ([_GOOD, "\tnode1 -- node1"], ":2: edge node1 -- node1 is a self-loop"),
        ([_GOOD, "\tnode1 -- node1", "\tnode1 -- node1"], ":3: duplicate edge 'node1 -- node1'"),
        ([_GOOD, _GOOD.replace("=8.0", "=[1.0; x]")], ":2: malformed activation_size list"),
        (
            [_GOOD, _GOOD.replace("node1", "node2"), "\tnode1 -- node2", "\tnode2 -- node1"],
            "the edges form a cycle",
        ),
        ([], "no node lines"),
    ],
)
def test_malformed_files_name_the_line(tmp_path: Path, lines: list[str], fragment: str) -> None:
    path = tmp_path / "graph.txt"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CostError) as info:
        CostGraph.from_pipedream(path)
    message = str(info.value)
    assert str(path) in message and fragment in message, message
    if "malformed node" in fragment:
        assert "forward_compute_time=x" in message and "a node line looks like" in message


def test_missing_pipedream_file() -> None:
    with pytest.raises(CostError, match="cannot read PipeDream file .*nowhere.txt"):
        CostGraph.from_pipedream("nowhere.txt")


def test_cost_graph_and_coarsen_import_without_torch() -> None:
    probe = (
        "import sys; sys.modules['torch'] = None\n"
        "import pdcompile\n"
        "from pdcompile import CostGraph\n"
        "from pdcompile.passes.coarsening import coarsen\n"
        f"g = CostGraph.from_pipedream({str(DATA / 'resnet50' / 'graph.txt')!r}, batch_size=128)\n"
        "g2 = CostGraph.from_json(g.to_json())\n"
        "assert g2 == g and len(coarsen(g2, 8).nodes) == 8\n"
        "print(sorted(m for m, v in sys.modules.items() if v is not None\n"
        "             and m.split('.')[0] in ('torch', 'torchvision', 'functorch')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
