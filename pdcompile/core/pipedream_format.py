"""PipeDream's profile format (`graph.txt`): reading it into a CostGraph and writing one out.

Node lines `nodeID -- description -- forward_compute_time=F, backward_compute_time=B,
activation_size=A, parameter_size=P` (F and B in milliseconds, A and P in bytes, A possibly a list
`[a; b; c]`), then edge lines `\tnodeA -- nodeB`. See docs/cost_graph.md for the mapping. The
format has one backward time: a split backward gets half of it in each part. A node above the
caps of `cost_graph_json.check_magnitudes` is refused, as in a CostGraph JSON file.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import networkx as nx

from pdcompile.core.cost_attrs import check_meta
from pdcompile.core.cost_graph import CostGraph, read_text
from pdcompile.core.cost_graph_json import check_magnitudes
from pdcompile.core.errors import CostError

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_COSTS = re.compile(
    rf"forward_compute_time=({_NUM}),\s*backward_compute_time=({_NUM}),\s*"
    rf"activation_size=(\[[^\]]*\]|{_NUM}),\s*parameter_size=({_NUM})"
)
_STAGE = re.compile(r"stage_id=(\d+)")
_NODE_LINE = (
    "node4 -- Conv2d(3, 64) -- forward_compute_time=22.307, backward_compute_time=24.613, "
    "activation_size=1644167168.0, parameter_size=7168.0"
)
_EDGE_LINE = "<TAB>node4 -- node5"


def _parse_node(where: str, line: str) -> tuple[str, dict[str, Any], int | None]:
    """One node line -> (id, attributes, stage id or None)."""
    tokens = line.split(" -- ")
    stage = None
    stage_match = _STAGE.fullmatch(tokens[-1].strip()) if len(tokens) >= 4 else None
    if stage_match:
        stage, tokens = int(stage_match.group(1)), tokens[:-1]
    costs = _COSTS.fullmatch(tokens[-1].strip()) if len(tokens) >= 3 else None
    node = tokens[0]
    if costs is None or not node or any(c.isspace() for c in node):
        raise CostError(
            f"{where}: malformed node line {line!r}; a node line looks like {_NODE_LINE!r} "
            "(and an edge line starts with a TAB)"
        )
    forward, backward, activation, param = costs.groups()
    if activation.startswith("["):
        inner = activation[1:-1].strip()
        items = [s.strip() for s in inner.split(";")] if inner else []
        if not all(re.fullmatch(_NUM, s) for s in items):
            raise CostError(
                f"{where}: malformed activation_size list {activation!r} in {line!r}; "
                "write it as [a; b; c]"
            )
        sizes: tuple[float, ...] | None = tuple(float(s) for s in items)
        total = math.fsum(sizes)
    else:
        sizes, total = None, float(activation)
    values = [float(forward), float(backward), total, float(param), *(sizes or ())]
    if any(x < 0 for x in values):
        raise CostError(f"{where}: negative time or size in {line!r}; all must be >= 0")
    if not all(math.isfinite(x) for x in values):
        raise CostError(f"{where}: a time or size in {line!r} is too large for a float")
    description = " -- ".join(tokens[1:-1])
    backward_s = float(backward) / 1000.0
    attrs = {
        "kind": "input" if description.startswith("Input") else "compute",
        "forward_s": float(forward) / 1000.0,
        "backward_s": backward_s,
        # PipeDream times the backward whole: half of it for each part of a split backward, and
        # W taken to keep every activation (the node's output: `activation_size`)
        "backward_input_s": backward_s / 2,
        "backward_weight_s": backward_s / 2,
        "activation_bytes": round(total),
        "weight_grad_activation_bytes": round(total),
        "output_bytes": round(total),
        "param_bytes": round(float(param)),
        "grad_bytes": round(float(param)),  # PipeDream trains every parameter it profiles
        "description": description,
        "activation_sizes": sizes,
    }
    return node, attrs, stage


def read_pipedream(path: Path, batch_size: int | None) -> CostGraph:
    nodes: dict[str, tuple[dict[str, Any], int]] = {}
    edges: dict[tuple[str, str], int] = {}
    stages: dict[str, int] = {}
    for lineno, raw in enumerate(read_text(path, "PipeDream").split("\n"), start=1):
        where, line = f"{path}:{lineno}", raw.rstrip("\r")
        if not line.strip():
            continue
        if not line[0].isspace():
            node, attrs, stage = _parse_node(where, line)
            if node in nodes:
                raise CostError(
                    f"{where}: node {node!r} is already defined on line {nodes[node][1]}; "
                    "node ids must be unique"
                )
            nodes[node] = (attrs, lineno)
            if stage is not None:
                stages[node] = stage
            continue
        pair = line.strip().split(" -- ")
        if len(pair) != 2 or not all(p and not any(c.isspace() for c in p) for p in pair):
            raise CostError(
                f"{where}: malformed edge line {line!r}; an edge line looks like {_EDGE_LINE!r}"
            )
        if (pair[0], pair[1]) in edges:
            raise CostError(f"{where}: duplicate edge {line.strip()!r}; list each edge once")
        edges[pair[0], pair[1]] = lineno
    if not nodes:
        raise CostError(f"{path}: no node lines; is this a PipeDream graph.txt?")
    for (u, v), lineno in edges.items():
        for end in (u, v):
            if end not in nodes:
                raise CostError(
                    f"{path}:{lineno}: edge {u} -- {v} names node {end!r}, which has no node "
                    "line; add the node line or remove the edge"
                )
        if u == v:
            raise CostError(f"{path}:{lineno}: edge {u} -- {v} is a self-loop; remove it")
    listed = list(nodes)
    order = _topological(path, listed, list(edges))
    graph = CostGraph(batch_size=batch_size)
    for node in order:
        graph.add_node(node, **nodes[node][0])
    for u, v in edges:
        graph.add_edge(u, v, graph.graph.nodes[u]["output_bytes"])
    extra: dict[str, Any] = {}
    if order != listed:
        extra["node_order"] = listed
    if [list(e) for e in edges] != _default_edge_order(graph, listed):
        extra["edge_order"] = [list(e) for e in edges]
    if stages:
        extra["stage_ids"] = stages
    graph.meta = check_meta({"source": "pipedream", **({"pipedream": extra} if extra else {})})
    check_magnitudes(graph, str(path))
    return graph


def _topological(path: Path, file_order: list[str], edges: list[tuple[str, str]]) -> list[str]:
    """The file's node order if it is topological, else the topological order closest to it."""
    pos = {n: i for i, n in enumerate(file_order)}
    if all(pos[u] < pos[v] for u, v in edges):
        return file_order
    dag = nx.DiGraph()
    dag.add_nodes_from(file_order)
    dag.add_edges_from(edges)
    if not nx.is_directed_acyclic_graph(dag):
        cycle = " -- ".join(u for u, _ in nx.find_cycle(dag))
        raise CostError(f"{path}: the edges form a cycle ({cycle}); remove one of its edges")
    return list(nx.lexicographical_topological_sort(dag, key=pos.__getitem__))


def _default_edge_order(graph: CostGraph, node_order: list[str]) -> list[list[str]]:
    """Edges grouped by source in `node_order`, each source's in insertion order."""
    return [[u, v] for u in node_order for v in graph.graph.successors(u)]


def _ms_text(seconds: float) -> str:
    """The shortest decimal milliseconds string `t` with `float(t) / 1000 == seconds`."""
    guess = seconds * 1000.0
    candidates, up, down = [guess], guess, guess
    for _ in range(4):
        up, down = math.nextafter(up, math.inf), math.nextafter(down, -math.inf)
        candidates += [up, down]
    texts = [repr(c) for c in candidates if c / 1000.0 == seconds]
    if not texts:  # no float maps exactly onto `seconds`: the nearest one
        return repr(guess)
    return min(texts, key=lambda t: (len(t), abs(float(t) - guess)))


def _size_text(x: float | int) -> str:
    return repr(x) if isinstance(x, float) else f"{x}.0"


def file_order(cost_graph: CostGraph) -> tuple[list[str], list[tuple[str, str]]]:
    """Nodes and edges in the order of the PipeDream file the graph came from (kept in
    `meta["pipedream"]`), else the graph's node order with edges grouped by source."""
    g = cost_graph.graph
    extra = cost_graph.meta.get("pipedream")
    extra = extra if isinstance(extra, dict) else {}
    order = extra.get("node_order")
    if not (isinstance(order, list) and len(order) == len(g) and set(order) == set(g)):
        order = list(g)
    edges = extra.get("edge_order")
    if not (
        isinstance(edges, list)
        and all(isinstance(e, list) and len(e) == 2 for e in edges)
        and len(edges) == g.number_of_edges()
        and {(e[0], e[1]) for e in edges} == set(g.edges)
    ):
        edges = _default_edge_order(cost_graph, order)
    return order, [(u, v) for u, v in edges]


def format_pipedream(cost_graph: CostGraph) -> str:
    check_magnitudes(cost_graph, "CostGraph.to_pipedream")  # what the reader would refuse
    g = cost_graph.graph
    extra = cost_graph.meta.get("pipedream")
    extra = extra if isinstance(extra, dict) else {}
    order, edge_order = file_order(cost_graph)
    stages = extra.get("stage_ids") if isinstance(extra.get("stage_ids"), dict) else {}
    lines = []
    for node in order:
        d = g.nodes[node]
        if any(c.isspace() for c in node) or " -- " in node:
            raise CostError(
                f"node {node!r}: PipeDream node ids cannot contain whitespace; rename the node"
            )
        if "\n" in d["description"] or "\r" in d["description"]:
            raise CostError(
                f"node {node!r}: its description spans lines, which PipeDream's one-line-per-"
                "node format cannot hold; put it on one line"
            )
        sizes = d["activation_sizes"]
        if sizes is not None and round(math.fsum(sizes)) == d["output_bytes"]:
            activation = "[" + "; ".join(_size_text(x) for x in sizes) + "]"
        else:
            activation = _size_text(d["output_bytes"])
        line = (
            f"{node} -- {d['description']} -- forward_compute_time={_ms_text(d['forward_s'])}, "
            f"backward_compute_time={_ms_text(d['backward_s'])}, activation_size={activation}, "
            f"parameter_size={_size_text(d['param_bytes'])}"
        )
        if isinstance(stages.get(node), int):
            line += f" -- stage_id={stages[node]}"
        lines.append(line)
    lines += [f"\t{u} -- {v}" for u, v in edge_order]
    return "\n".join(lines) + "\n"


# -- human units ---------------------------------------------------------------------------
