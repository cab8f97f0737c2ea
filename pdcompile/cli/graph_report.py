"""Views of a captured graph for people and tools: a rich table, JSON, Graphviz DOT, SVG and PNG."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from rich.table import Table

from pdcompile.core.errors import PdcompileError
from pdcompile.core.ir import (
    AUTO_LEAVES,
    CAPTURE,
    CONSTANTS,
    INPUTS,
    OUTPUT_BYTES,
    OUTPUTS,
    TRAINING,
    module_path,
    owned_params,
    param_table,
    target_name,
)
from pdcompile.core.text import dot_quote, human_bytes
from pdcompile.passes.planning.plans import Plan
from pdcompile.pictures.stage_colours import crosses, crossing_edge, stage_colour, stages_of

GRAPHVIZ_HINT = (
    "Graphviz's `dot` program was not found; install Graphviz (Debian/Ubuntu: "
    "apt-get install graphviz; macOS: brew install graphviz) or use --format dot"
)


@dataclass(frozen=True)
class NodeRow:
    """One node of the graph as the reports show it."""

    name: str
    op: str
    target: str
    module: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    bytes: int
    param_count: int
    param_bytes: int
    shared_params: tuple[str, ...]  # owned parameters that other nodes use too (tied)

    @property
    def shape_text(self) -> str:
        return "; ".join(f"[{', '.join(map(str, s))}]" for s in self.shapes)


def node_rows(gm: fx.GraphModule) -> list[NodeRow]:
    """One row per node, in graph order."""
    rows = []
    for node in gm.graph.nodes:
        params = [p for p in owned_params(gm, node) if not p.is_buffer]
        outputs = node.meta.get(OUTPUTS, ())
        rows.append(
            NodeRow(
                name=node.name,
                op=node.op,
                target=target_name(node),
                module=module_path(node),
                shapes=tuple(s.shape for s in outputs),
                dtypes=tuple(s.dtype for s in outputs),
                bytes=node.meta.get(OUTPUT_BYTES, 0),
                param_count=sum(p.numel for p in params),
                param_bytes=sum(p.nbytes for p in params),
                shared_params=tuple(p.name for p in params if len(p.users) > 1),
            )
        )
    return rows


def totals(gm: fx.GraphModule) -> dict[str, int]:
    """Whole-graph sums; each tied parameter is counted once."""
    table = param_table(gm).values()
    params = [p for p in table if not p.is_buffer]
    return {
        "nodes": len(gm.graph.nodes),
        "output_bytes": sum(n.meta.get(OUTPUT_BYTES, 0) for n in gm.graph.nodes),
        "param_count": sum(p.numel for p in params),
        "param_bytes": sum(p.nbytes for p in params),
        "buffer_bytes": sum(p.nbytes for p in table if p.is_buffer),
        "unused_tensors": sum(1 for p in table if not p.users),
    }


def to_table(gm: fx.GraphModule, title: str) -> Table:
    """A rich table: one row per node, totals at the bottom."""
    table = Table(title=title, show_footer=True, header_style="bold")
    t = totals(gm)
    table.add_column("name", footer=f"{t['nodes']} nodes")
    table.add_column("op")
    table.add_column("target")
    table.add_column("output", footer="")
    table.add_column("dtype")
    table.add_column("bytes", justify="right", footer=human_bytes(t["output_bytes"]))
    table.add_column("params", justify="right", footer=f"{t['param_count']:,}")
    table.add_column("param bytes", justify="right", footer=human_bytes(t["param_bytes"]))
    for row in node_rows(gm):
        shared = " (tied)" if row.shared_params else ""
        table.add_row(
            row.name,
            row.op,
            row.target,
            row.shape_text,
            ", ".join(dict.fromkeys(row.dtypes)),
            human_bytes(row.bytes) if row.shapes else "",
            f"{row.param_count:,}{shared}" if row.param_count else "",
            human_bytes(row.param_bytes) if row.param_count else "",
        )
    captured = gm.meta.get(CAPTURE, "?")
    mode = "train" if gm.meta.get(TRAINING, True) else "eval"
    table.caption = f"captured by {captured} in {mode} mode"
    return table


def to_json(gm: fx.GraphModule, model_name: str) -> str:
    """The table's content, machine-readable."""
    doc: dict[str, Any] = {
        "model": model_name,
        "capture": gm.meta.get(CAPTURE),
        "training": gm.meta.get(TRAINING),
        "inputs": list(gm.meta.get(INPUTS, ())),
        "constants": dict(gm.meta.get(CONSTANTS, ())),
        "auto_leaves": dict(gm.meta.get(AUTO_LEAVES, ())),
        "nodes": [
            {
                "name": r.name,
                "op": r.op,
                "target": r.target,
                "module": r.module,
                "shapes": [list(s) for s in r.shapes],
                "dtypes": list(r.dtypes),
                "bytes": r.bytes,
                "param_count": r.param_count,
                "param_bytes": r.param_bytes,
                "shared_params": list(r.shared_params),
                "args": [a.name for a in node.all_input_nodes],
            }
            for r, node in zip(node_rows(gm), gm.graph.nodes, strict=True)
        ],
        "params": [p.to_json() for p in param_table(gm).values()],
        "totals": totals(gm),
    }
    return json.dumps(doc, indent=2)


_NODE_STYLE = {
    "placeholder": 'shape=ellipse, style=filled, fillcolor="#d9ead3"',
    "output": 'shape=ellipse, style=filled, fillcolor="#d9ead3"',
    "call_module": 'shape=box, style="rounded,filled", fillcolor="#cfe2f3"',
    "get_attr": 'shape=note, style=filled, fillcolor="#fff2cc"',
}


_STAGE_SHAPE = {"placeholder": "ellipse", "output": "ellipse", "get_attr": "note"}


def to_dot(gm: fx.GraphModule, model_name: str, plan: Plan | None = None) -> str:
    """Graphviz text: one box per node, edges labelled with the shape of the tensor they carry.

    With `plan`, the nodes it places are filled with their stage's colour and name it, and
    edges between stages are drawn in red with the bytes they carry.

    Raises:
        PartitionError: the plan places nodes the graph does not have.
    """
    rows = {r.name: r for r in node_rows(gm)}
    stage = stages_of(plan, rows, f"the graph of {model_name}") if plan else {}
    lines = [
        f"digraph {dot_quote(model_name)} {{",
        "  rankdir=TB;",
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=9];',
    ]
    for node in gm.graph.nodes:
        row = rows[node.name]
        label = f"{row.name}\n{row.op}: {row.target}"
        if row.param_count:
            label += f"\nparams {row.param_count:,}"
        style = _NODE_STYLE.get(node.op, "shape=box")
        if node.name in stage:
            label += f"\nstage {stage[node.name]}"
            shape = _STAGE_SHAPE.get(node.op, "box")
            style = f'shape={shape}, style=filled, fillcolor="{stage_colour(stage[node.name])}"'
        lines.append(f"  {dot_quote(node.name)} [label={dot_quote(label)}, {style}];")
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            shape = rows[arg.name].shape_text
            label = f" [label={dot_quote(shape)}]" if shape else ""
            if crosses(stage, arg.name, node.name):
                label = f" [{crossing_edge(shape, rows[arg.name].bytes)}]"
            lines.append(f"  {dot_quote(arg.name)} -> {dot_quote(node.name)}{label};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_dot(dot_text: str, fmt: str) -> bytes:
    """Draw DOT text as `svg` or `png` with Graphviz's `dot` program."""
    exe = shutil.which("dot")
    if exe is None:
        raise PdcompileError(GRAPHVIZ_HINT)
    done = subprocess.run(
        [exe, f"-T{fmt}"], input=dot_text.encode(), capture_output=True, check=False
    )
    if done.returncode != 0:
        raise PdcompileError(
            f"Graphviz's dot failed: {done.stderr.decode(errors='replace').strip()}"
        )
    return done.stdout
