"""The CostGraph JSON format (`CostGraph.to_json`, `from_json`, `save`, `load`).

`{"format": "pdcompile.costgraph", "version": 4, "batch_size", "loss_forward_s",
"loss_backward_s", "optimizer", "rows", "loss_row_s", "meta", "nodes", "edges"}`, one node
(`{"id", **NODE_ATTRS}`) or edge (`{"src", "dst", "bytes"}`) per line, so that diffs of two
profiles read line by line. Reading checks every field and names the node or edge at fault.
Version 3 files (one profile) read too: no `rows`, `loss_row_s` nor nodes' `row_s` (the times
scale linearly, `CostGraph.row_scaling` says so). Version 2 files (before the loss and the
optimizer step) read too: the graph has no loss (0.0), no optimizer named, and its nodes lack
`STEP_COST_ATTRS` (0.0: the step unpriced, the spread unknown). Version 1 files (before the
split backward) also lack `SPLIT_ATTRS`, which take `CostGraph.add_node`'s defaults (half of
`backward_s` each; W keeps every activation).
Both formats (this one and the PipeDream profile's) refuse to read or write a node or edge above
`MAX_SECONDS`, `MAX_BYTES` or `MAX_FLOPS` (`check_magnitudes`).
"""

from __future__ import annotations

import json
from typing import Any

from pdcompile.core.cost_attrs import (
    ACCUMULATE_ATTRS,
    FLOP_ATTRS,
    INT_ATTRS,
    NODE_ATTRS,
    ROW_ATTRS,
    SETTABLE,
    SPLIT_ATTRS,
    STEP_ATTRS,
    STEP_COST_ATTRS,
    TIME_ATTRS,
    check_attr,
)
from pdcompile.core.cost_graph import FORMAT, READS, VERSION, CostGraph
from pdcompile.core.errors import CostError

# The most one node (or edge) of a file may cost, per batch: far above any real layer, so a
# figure past it is a corrupt file or other units. Under them the sums of a graph's figures
# stay finite, and a plan's byte counts within a plan file's integers (below 2**63).
MAX_SECONDS = 1e12  # about 32,000 years
MAX_BYTES = 2**53  # 8 PiB: byte counts up to here are exact as floats
MAX_FLOPS = 1e30
_CAPS = {
    **dict.fromkeys(
        (*TIME_ATTRS, *STEP_ATTRS, *ACCUMULATE_ATTRS), ("seconds", MAX_SECONDS, "MAX_SECONDS")
    ),
    **dict.fromkeys(  # memory_bytes: the sum of four parts under the cap
        (*(a for a in INT_ATTRS if a != "memory_bytes"), "activation_sizes"),
        ("bytes", MAX_BYTES, "MAX_BYTES"),
    ),
    **dict.fromkeys(FLOP_ATTRS, ("FLOPs", MAX_FLOPS, "MAX_FLOPS")),
}


def format_json(graph: CostGraph) -> str:
    """`graph` as JSON, one node or edge per line; `read_json` reads it back exactly (a figure
    above the caps raises `CostError` here, as it would there)."""
    check_magnitudes(graph, "CostGraph.to_json")

    def dump(obj: Any) -> str:
        return json.dumps(obj, allow_nan=False)

    def rows(items: list[str]) -> str:
        return ",".join("\n  " + item for item in items)

    nodes = []
    for node, data in graph.graph.nodes(data=True):
        record = {k: _listed(v) for k, v in data.items()}
        nodes.append(dump({"id": node, **record}))
    edges = [
        dump({"src": u, "dst": v, "bytes": d["bytes"], **({} if d["grad"] else {"grad": False})})
        for u, v, d in graph.graph.edges(data=True)
    ]  # `grad` written only where no gradient flows back
    head = {"format": FORMAT, "version": VERSION, "batch_size": graph.batch_size}
    head.update({k: _listed(v) for k, v in graph.step_costs().items()})
    return (
        f"{dump(head)[:-1]},\n"
        f' "meta": {dump(graph.meta)},\n'
        f' "nodes": [{rows(nodes)}\n ],\n'
        f' "edges": [{rows(edges)}\n ]\n}}\n'
    )


def read_json(text: str, source: str = "<string>") -> CostGraph:
    """The graph `format_json` wrote; `CostGraph.from_json` says what it raises."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CostError(
            f"{source}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); the file is truncated "
            "or corrupt: write it again with CostGraph.save()"
        ) from None
    except RecursionError:
        raise CostError(
            f"{source}: JSON nested too deeply for a CostGraph; the file is corrupt: write it "
            "again with CostGraph.save()"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise CostError(
            f"{source}: not a CostGraph file (format is {found!r}, expected {FORMAT!r})"
        )
    version = doc.get("version")
    if type(version) is not int or version not in READS:
        raise CostError(
            f"{source}: CostGraph format version {version!r}; this pdcompile reads versions "
            f"{', '.join(map(str, READS[:-1]))} and {READS[-1]}: upgrade pdcompile or write the "
            "file again with "
            "this version"
        )
    fields = {"format", "version", "batch_size", "meta", "nodes", "edges"}
    if version >= 3:
        fields |= {"loss_forward_s", "loss_backward_s", "optimizer"}
    if version >= 4:
        fields |= {"rows", "loss_row_s"}
    if set(doc) != fields:
        raise CostError(
            f"{source}: top-level fields must be {sorted(fields)}; missing "
            f"{sorted(fields - set(doc))}, unknown {sorted(set(doc) - fields)}"
        )
    if not isinstance(doc["nodes"], list) or not isinstance(doc["edges"], list):
        raise CostError(f"{source}: 'nodes' and 'edges' must be lists")
    try:
        names = ("loss_forward_s", "loss_backward_s", "optimizer", "rows", "loss_row_s")
        step = {k: doc[k] for k in names if k in doc}
        graph = CostGraph(batch_size=doc["batch_size"], meta=doc["meta"], **step)
        for i, record in enumerate(doc["nodes"]):
            _add_json_node(graph, i, record, version)
        for i, record in enumerate(doc["edges"]):
            if not isinstance(record, dict) or not (
                {"src", "dst", "bytes"} <= set(record) <= {"src", "dst", "bytes", "grad"}
            ):
                raise CostError(
                    f"edge #{i} must be an object with 'src', 'dst', 'bytes' and optionally "
                    f"'grad', got {record!r}"
                )
            if not (isinstance(record["src"], str) and isinstance(record["dst"], str)):
                raise CostError(f"edge #{i}: 'src' and 'dst' must be node ids, got {record!r}")
            graph.add_edge(record["src"], record["dst"], record["bytes"], record.get("grad", True))
    except CostError as e:
        raise CostError(f"{source}: {e}") from None
    check_magnitudes(graph, source)
    return graph


def check_magnitudes(graph: CostGraph, source: str) -> None:
    """Raise `CostError` naming the first node or edge of `graph` (read from `source`) with
    seconds, bytes or FLOPs above `MAX_SECONDS`, `MAX_BYTES` or `MAX_FLOPS`."""
    names = list(graph.graph.nodes)
    data = [graph.graph.nodes[n] for n in names]
    edges = list(graph.graph.edges(data="bytes"))
    figures = {  # name -> (the figure of each node or edge, the attribute whose cap applies)
        name: ([d[name] for d in data], name) for name in _CAPS if name != "activation_sizes"
    }
    figures["activation_sizes"] = ([max(d["activation_sizes"] or (0,)) for d in data], None)
    figures["loss"] = ([graph.loss_forward_s, graph.loss_backward_s], "forward_s")
    figures["row_s"] = ([max((max(p) for p in d["row_s"] or ()), default=0.0) for d in data],
                        "forward_s")  # fmt: skip
    loss_points = [x for p in graph.loss_row_s or () for x in p]
    figures["loss_row_s"] = (loss_points, "forward_s")
    figures["bytes"] = ([b for _, _, b in edges], "output_bytes")
    for name, (values, like) in figures.items():
        unit, cap, constant = _CAPS[like or name]
        if values and max(values) > cap:
            i = next(i for i, v in enumerate(values) if v > cap)
            where = (
                "the graph" if name in ("loss", "loss_row_s")
                else f"edge {edges[i][0]!r} -> {edges[i][1]!r}" if name == "bytes"
                else f"node {names[i]!r}"
            )  # fmt: skip
            raise CostError(
                f"{source}: {where}: {name} is {values[i]:.4g} {unit}, above the {cap:.4g} one "
                f"node may cost (pdcompile.core.cost_graph_json.{constant}); the file is corrupt "
                "or in other units (seconds, bytes): write it again"
            )


def _add_json_node(graph: CostGraph, index: int, record: Any, version: int) -> None:
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        raise CostError(f"node #{index} must be an object with a string 'id', got {record!r}")
    node = record["id"]
    absent = (
        *(SPLIT_ATTRS if version < 2 else ()),
        *(STEP_COST_ATTRS if version < 3 else ()),
        *(ROW_ATTRS if version < 4 else ()),
    )
    fields = [a for a in NODE_ATTRS if a not in absent]
    missing = [a for a in fields if a not in record]
    unknown = sorted(set(record) - {"id", *fields})
    if missing or unknown:
        raise CostError(
            f"node #{index} {node!r}: missing fields {missing}, unknown fields {unknown}; "
            "write the file with CostGraph.to_json"
        )
    graph.add_node(node, **{a: record[a] for a in SETTABLE if a in fields})
    memory = check_attr(node, "memory_bytes", record["memory_bytes"])
    if memory != graph.graph.nodes[node]["memory_bytes"]:
        raise CostError(
            f"node #{index} {node!r}: field 'memory_bytes' is {memory} but param + grad + "
            f"optimizer + activation bytes is {graph.graph.nodes[node]['memory_bytes']}"
        )


def _listed(value: Any) -> Any:
    """Tuples (nested too) as JSON lists."""
    return [_listed(v) for v in value] if isinstance(value, tuple) else value
