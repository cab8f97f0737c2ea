"""Coarsening: convex layers, an acyclic quotient, totals kept, module boundaries, speed."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from pathlib import Path

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcompile import CostError, CostGraph
from pdcompile.passes.coarsening import coarsen

DATA = Path(__file__).parent / "data" / "pipedream"


def transformer(num_blocks: int, num_experts: int, *, extras: bool = True) -> CostGraph:
    """A synthetic model: blocks with skip connections and branches (attention q/k/v, experts).

    With `extras`, an input, an embedding, a head (the output) and a module `shared.proj` called
    in blocks 3 and 9, so its scope appears twice, apart.
    """
    rng = random.Random(num_blocks * 1000 + num_experts)
    g = CostGraph(batch_size=8, meta={"source": "synthetic"})

    def node(name: str, scope: str, inputs: list[str], **attrs: object) -> str:
        cost = {"forward_s": rng.random() * 1e-3, "backward_s": rng.random() * 2e-3}
        sizes = {"param_bytes": rng.randrange(10**6), "activation_bytes": rng.randrange(10**6)}
        g.add_node(name, scope=scope, output_bytes=rng.randrange(1, 10**5), **cost, **sizes)
        for source in inputs:
            g.add_edge(source, name, g.graph.nodes[source]["output_bytes"])
        return name

    x = "x"
    if extras:
        g.add_node("x", kind="input", output_bytes=4096)
        x = node("embed", "embed", ["x"])
    for b in range(num_blocks):
        p = f"layers.{b}"
        ln1 = node(f"{p}.ln1", f"{p}.ln1", [x] if extras or b else [])
        q, k, v = (node(f"{p}.attn.{n}", f"{p}.attn.{n}", [ln1]) for n in "qkv")
        scores = node(f"{p}.attn.softmax", f"{p}.attn", [q, k])
        out = node(f"{p}.attn.out", f"{p}.attn.out", [scores, v])
        x = node(f"{p}.add1", p, [x, out] if extras or b else [out])  # skip connection
        if extras and b in (3, 9):
            x = node(f"shared.proj.{b}", "shared.proj", [x])
        ln2 = node(f"{p}.ln2", f"{p}.ln2", [x])
        router = node(f"{p}.mlp.router", f"{p}.mlp.router", [ln2])
        experts = []
        for e in range(num_experts):
            s = f"{p}.mlp.experts.{e}"
            fc1 = node(f"{s}.fc1", f"{s}.fc1", [ln2, router])
            act = node(f"{s}.act", s, [fc1])
            experts.append(node(f"{s}.fc2", f"{s}.fc2", [act]))
        combine = node(f"{p}.mlp.combine", f"{p}.mlp", [router, *experts])
        x = node(f"{p}.add2", p, [x, combine])
    if extras:
        node("head", "head", [x])
        g.graph.nodes["head"]["kind"] = "output"
    return g


def reachable(step: Callable[[str], Iterable[str]], sources: set[str]) -> set[str]:
    """Every node reachable from `sources` (included) following `step`."""
    seen, todo = set(sources), list(sources)
    while todo:
        for nxt in step(todo.pop()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def check_layers(
    original: CostGraph, coarse: CostGraph, max_layers: int, *, edges: bool = True
) -> list[list[str]]:
    """Every property a coarsening must have; returns the layers' member lists.

    `edges=False` skips the edge-bytes rule, which holds against the graph that was coarsened
    (not against the original nodes once a coarsened graph is coarsened again).
    """
    coarse.validate()
    layers = [list(coarse.graph.nodes[n]["members"]) for n in coarse.nodes]
    assert len(layers) <= max_layers
    assert len(layers) == min(max_layers, len(original.nodes))
    members = [m for layer in layers for m in layer]
    assert sorted(members) == sorted(original.nodes)  # a partition of the original nodes
    for key, total in original.totals().items():  # fsum of fsums: equal to the last bits
        assert math.isclose(coarse.totals()[key], total, rel_tol=1e-12, abs_tol=1e-300), key
    g = original.graph
    for layer in layers:  # convex: no node outside is both reached from and reaching the layer
        inside = set(layer)
        below = reachable(g.successors, inside) - inside
        above = reachable(g.predecessors, inside) - inside
        assert not below & above, (layer, below & above)
    assert nx.is_directed_acyclic_graph(coarse.graph)
    for name, data in coarse.graph.nodes(data=True):
        kinds = {g.nodes[m]["kind"] for m in data["members"]}
        assert data["kind"] == (kinds.pop() if len(kinds) == 1 else "compute"), name
    assert coarse.meta["coarsened_from"] == len(original.nodes)
    layer_of = {m: i for i, layer in enumerate(layers) for m in layer}
    if not edges:
        return layers
    expected: dict[tuple[int, int], int] = {}
    for u in g:  # a tensor crosses into a layer once: the largest of its edges into it
        into: dict[int, int] = {}
        for v in g.successors(u):
            if layer_of[v] != layer_of[u]:
                into[layer_of[v]] = max(into.get(layer_of[v], 0), g.edges[u, v]["bytes"])
        for b, nbytes in into.items():
            expected[layer_of[u], b] = expected.get((layer_of[u], b), 0) + nbytes
    got = {
        (coarse.nodes.index(u), coarse.nodes.index(v)): b
        for u, v, b in coarse.graph.edges(data="bytes")
    }
    assert got == expected
    return layers


def test_two_thousand_nodes_to_64_layers() -> None:
    g = transformer(12, 52)  # its speed is measured by benchmarks/coarsening.py, not asserted
    assert 2000 <= len(g.nodes) <= 2020
    coarse = coarsen(g, 64)
    layers = check_layers(g, coarse, 64)
    assert coarse.nodes == [f"L{i:03d}" for i in range(64)]
    assert layers[0] == ["x"] and coarse.graph.nodes["L000"]["kind"] == "input"
    # 64 layers allow every cut between blocks and between top-level modules to stay: each
    # layer lies inside one module two levels deep (layers.7, shared.proj, embed, ...).
    for layer in layers[1:]:
        assert len({tuple(g.graph.nodes[m]["scope"].split(".")[:2]) for m in layer}) == 1
    shared = [i for i, layer in enumerate(layers) if any(m.startswith("shared") for m in layer)]
    assert [layers[i] for i in shared] == [["shared.proj.3"], ["shared.proj.9"]]
    assert coarse.graph.nodes[coarse.nodes[shared[0]]]["scope"] == "shared.proj"


def test_each_block_becomes_a_layer() -> None:
    g = transformer(12, 2, extras=False)
    layers = check_layers(g, coarsen(g, 12), 12)
    for b, layer in enumerate(layers):
        assert {m.split(".")[1] for m in layer} == {str(b)}
    coarse = coarsen(g, 12)
    assert [coarse.graph.nodes[n]["scope"] for n in coarse.nodes] == [
        f"layers.{b}" for b in range(12)
    ]
    first = f"layers.0: {len(layers[0])} nodes layers.0.ln1..layers.0.add2"
    assert coarse.graph.nodes["L000"]["description"] == first


def test_input_layer_is_kept_apart_until_one_layer_remains() -> None:
    g = transformer(12, 2)
    layers = check_layers(g, coarsen(g, 16), 16)
    assert layers[0] == ["x"]
    one = coarsen(g, 1)
    check_layers(g, one, 1)
    assert one.graph.nodes["L000"]["kind"] == "compute"
    two = coarsen(g, 2)
    assert check_layers(g, two, 2)[0] == ["x"]


def test_coarsening_pipedream_resnet50_to_16_layers() -> None:
    g = CostGraph.from_pipedream(DATA / "resnet50" / "graph.txt", batch_size=128)
    coarse = coarsen(g, 16)
    layers = check_layers(g, coarse, 16)
    assert layers[0] == ["node1"] and coarse.graph.nodes["L000"]["kind"] == "input"
    assert "pipedream" not in coarse.meta and coarse.meta["source"] == "pipedream"
    assert coarse.batch_size == 128
    # the greedy merge evens out compute: no layer is more than 3x the mean
    times = [d["forward_s"] + d["backward_s"] for _, d in coarse.graph.nodes(data=True)]
    assert max(times[1:]) < 3 * sum(times[1:]) / 15


def test_gnmt_inputs_form_the_first_layer() -> None:
    g = CostGraph.from_pipedream(DATA / "gnmt" / "graph.txt")
    layers = check_layers(g, coarsen(g, 10), 10)
    assert layers[0] == ["node1", "node2", "node3"]


def test_small_cases() -> None:
    g = transformer(2, 1)
    assert coarsen(g, len(g.nodes)) == g and coarsen(g, 10**6) == g
    for bad in (0, -3, 2.5, True, None):
        with pytest.raises(CostError, match="max_layers must be an integer >= 1"):
            coarsen(g, bad)  # type: ignore[arg-type]
    twice = coarsen(coarsen(g, 12), 5)
    check_layers(g, twice, 5, edges=False)
    assert twice.meta["coarsened_from"] == len(g.nodes)
    assert coarsen(g, 7) == coarsen(g, 7)  # deterministic


def test_a_producer_read_twice_by_a_layer_sends_once() -> None:
    g = CostGraph(batch_size=1)
    for name, scope in [("u", "a"), ("w", "a"), ("v1", "b"), ("v2", "b")]:
        g.add_node(name, scope=scope, forward_s=1.0)
    g.add_edge("u", "v1", 100)
    g.add_edge("u", "v2", 100)
    g.add_edge("w", "v1", 50)
    coarse = coarsen(g, 2)
    assert [coarse.graph.nodes[n]["members"] for n in coarse.nodes] == [("u", "w"), ("v1", "v2")]
    assert coarse.graph.edges["L000", "L001"]["bytes"] == 150


@st.composite
def random_dags(draw: st.DrawFn) -> CostGraph:
    n = draw(st.integers(1, 9))
    g = CostGraph(batch_size=draw(st.integers(1, 64)))
    scopes = st.sampled_from(["", "a", "a.x", "a.y", "b", "b.x.1", "b.x.2"])
    times = st.floats(0, 1e-2, allow_nan=False)
    for i in range(n):
        kind = draw(st.sampled_from(["compute", "compute", "input", "output"]))
        g.add_node(
            f"n{i}",
            kind=kind,
            scope=draw(scopes),
            forward_s=draw(times),
            backward_s=draw(times),
            flops_forward=draw(times),
            output_bytes=draw(st.integers(0, 1000)),
        )
    for i, j in sorted(draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))))):
        if i < j:
            g.add_edge(f"n{i}", f"n{j}", draw(st.integers(0, 1000)))
    return g


@settings(deadline=None, max_examples=200)
@given(random_dags(), st.integers(1, 10))
def test_random_dags_give_convex_layers(g: CostGraph, max_layers: int) -> None:
    coarse = coarsen(g, max_layers)
    if max_layers >= len(g.nodes):
        assert coarse == g
        return
    layers = check_layers(g, coarse, max_layers)
    for layer in layers:  # brute force: every node on a path between two members is a member
        for u in layer:
            for w in layer:
                for x in set(g.nodes) - set(layer):
                    assert not (nx.has_path(g.graph, u, x) and nx.has_path(g.graph, x, w))
    sources = [
        n for n in g.nodes if g.graph.in_degree(n) == 0 and g.graph.nodes[n]["kind"] == "input"
    ]
    first = coarse.graph.nodes["L000"]
    if sources and len(sources) < len(g.nodes) and max_layers > 1:  # inputs stay apart
        assert set(first["members"]) <= set(sources) and first["kind"] == "input"


def test_scope_of_a_layer_is_the_common_module_path() -> None:
    g = CostGraph()
    for name, scope in [("a", "enc.0.attn"), ("b", "enc.0.mlp"), ("c", "enc.1"), ("d", "dec")]:
        g.add_node(name, scope=scope, forward_s=1.0)
    coarse = coarsen(g, 3)
    assert [coarse.graph.nodes[n]["scope"] for n in coarse.nodes] == ["enc.0", "enc.1", "dec"]
    assert coarse.graph.nodes["L000"]["description"] == "enc.0: 2 nodes a..b"
    assert coarse.graph.nodes["L001"]["members"] == ("c",)
