"""Views of a CostGraph for people: a table of the costliest nodes, Graphviz DOT (torch-free)."""

from __future__ import annotations

from rich.table import Table

from pdcompile.cost_graph import CostGraph
from pdcompile.pictures.stage_colours import crosses, crossing_edge, stage_colour, stages_of
from pdcompile.plans import Plan
from pdcompile.text import dot_quote, human_bytes, human_seconds


def cost_table(graph: CostGraph, title: str, top: int | None = None) -> Table:
    """One row per node (the `top` costliest by forward + backward time), totals at the bottom."""
    nodes = graph.nodes
    if top is not None:
        cost = {
            n: graph.graph.nodes[n]["forward_s"] + graph.graph.nodes[n]["backward_s"] for n in nodes
        }
        nodes = sorted(nodes, key=lambda n: -cost[n])[:top]
    t = graph.totals()
    table = Table(title=title, show_footer=True, header_style="bold")
    shown = (
        f"{len(nodes)} of {len(graph.nodes)} nodes" if top is not None else f"{len(nodes)} nodes"
    )
    table.add_column("node", footer=shown)
    table.add_column("kind")
    table.add_column("module or layer")
    table.add_column("forward", justify="right", footer=human_seconds(t["forward_s"]))
    table.add_column("backward", justify="right", footer=human_seconds(t["backward_s"]))
    table.add_column(
        "GFLOP", justify="right", footer=f"{(t['flops_forward'] + t['flops_backward']) / 1e9:.3f}"
    )
    table.add_column("params", justify="right", footer=human_bytes(t["param_bytes"]))
    table.add_column("activations", justify="right", footer=human_bytes(t["activation_bytes"]))
    table.add_column("output", justify="right")
    for name in nodes:
        a = graph.graph.nodes[name]
        table.add_row(
            name,
            a["kind"],
            a["scope"] or a["description"][:48],
            human_seconds(a["forward_s"]),
            human_seconds(a["backward_s"]),
            f"{(a['flops_forward'] + a['flops_backward']) / 1e9:.3f}",
            human_bytes(a["param_bytes"]) if a["param_bytes"] else "",
            human_bytes(a["activation_bytes"]) if a["activation_bytes"] else "",
            human_bytes(a["output_bytes"]) if a["output_bytes"] else "",
        )
    source = graph.meta.get("source", "?")
    memory = human_bytes(t["memory_bytes"])
    table.caption = f"costs from {source}, batch size {graph.batch_size}; memory total {memory}"
    return table


def cost_dot(graph: CostGraph, name: str, plan: Plan | None = None) -> str:
    """Graphviz text: nodes with their times, edges with the bytes they carry.

    With `plan`, the nodes it places are filled with their stage's colour and name it, and
    edges between stages are drawn in red.

    Raises:
        PartitionError: the plan places nodes the CostGraph does not have.
    """
    stage = stages_of(plan, graph.nodes, f"the CostGraph {name}") if plan else {}
    lines = [
        f"digraph {dot_quote(name)} {{",
        '  node [shape=box, fontname="Helvetica", fontsize=10];',
    ]
    for node in graph.nodes:
        a = graph.graph.nodes[node]
        times = f"fwd {human_seconds(a['forward_s'])}, bwd {human_seconds(a['backward_s'])}"
        label = f"{node}\n{a['description']}\n{times}"
        style = ', style=filled, fillcolor="#d9ead3"' if a["kind"] != "compute" else ""
        if node in stage:
            label += f"\nstage {stage[node]}"
            style = f', style=filled, fillcolor="{stage_colour(stage[node])}"'
        lines.append(f"  {dot_quote(node)} [label={dot_quote(label)}{style}];")
    for u, v, data in graph.graph.edges(data=True):
        edge = f"label={dot_quote(human_bytes(data['bytes']))}"
        if crosses(stage, u, v):
            edge = crossing_edge("", data["bytes"])
        lines.append(f"  {dot_quote(u)} -> {dot_quote(v)} [{edge}];")
    lines.append("}")
    return "\n".join(lines) + "\n"
