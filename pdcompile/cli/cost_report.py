"""Views of a CostGraph for people: a table of the costliest nodes, Graphviz DOT (torch-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.text import dot_quote, human_bytes, human_seconds
from pdcompile.passes.planning.plans import Plan
from pdcompile.pictures.stage_colours import crosses, crossing_edge, stage_colour, stages_of

if TYPE_CHECKING:  # torch-free at run time
    from pdcompile.passes.framework_cost import FrameworkCost


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
    stepped = t["optimizer_s"] > 0  # the optimizer step per node, where it was priced
    if stepped:
        table.add_column("optimizer", justify="right", footer=human_seconds(t["optimizer_s"]))
    for name in nodes:
        a = graph.graph.nodes[name]
        step = [human_seconds(a["optimizer_s"]) if a["optimizer_s"] else ""] if stepped else []
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
            *step,
        )
    source = graph.meta.get("source", "?")
    memory = human_bytes(t["memory_bytes"])
    table.caption = (
        f"costs from {source}, batch size {graph.batch_size} (times against rows: "
        f"{graph.row_scaling}); memory total {memory}; " + _step_caption(graph)
    )
    return table


def _step_caption(graph: CostGraph) -> str:
    """The loss (on the stage holding `loss_node`) and what priced the optimizer column."""
    loss = (
        f"loss forward {human_seconds(graph.loss_forward_s)}, backward "
        f"{human_seconds(graph.loss_backward_s)} (at {graph.loss_node})"
        if graph.loss_s
        else "loss not priced"
    )
    return f"{loss}; optimizer step: {graph.optimizer or 'not priced'}"


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


def noisy_table(graph: CostGraph) -> Table | None:
    """The profile's noisy times (`ProfileSettings.noisy`: spread above `MAX_SPREAD` after their
    rounds), or None when there are none or the costs were not profiled."""
    noisy = (graph.meta.get("profile") or {}).get("noisy") or []
    if not noisy:
        return None
    table = Table(title="noisy times: repeats spread widely after measuring again")
    for column in ("node", "time", "median", "spread", "rounds"):
        table.add_column(column, justify="left" if column in ("node", "time") else "right")
    for node, direction, median, spread, rounds in noisy:
        table.add_row(node, direction, human_seconds(median), f"{spread:.2f}", str(rounds))
    table.caption = "spread = (p75 - p25) / median of the repeats; the medians are used"
    return table


def framework_line(graph: CostGraph) -> str | None:
    """One line on the framework cost folded into the times (None when none was)."""
    folded = graph.meta.get("framework")
    if not folded:
        return None
    cost, how = folded["cost"], folded["mode"]
    where = f"cached in {cost['cache_path']}" if cost.get("cache_path") else "not cached"
    share = (
        f"{human_seconds(folded['forward_s'])} of the forward and "
        f"{human_seconds(folded['backward_s'])} of the backward"
    )
    return (
        f"framework cost folded in ({how}): {cost['forward_op_s'] * 1e6:.3g} us per op forward, "
        f"{cost['backward_node_s'] * 1e6:.3g} us per autograd node and "
        f"{cost['backward_op_s'] * 1e6:.3g} us per op backward, {share}; "
        f"calibrated on {cost['host']} ({cost['device']}, {_threads(cost['num_threads'])}, torch "
        f"{cost['torch_version']}) at {cost['measured_at']}, {where}"
    )


def calibration_table(cost: FrameworkCost) -> Table:
    """`pdcompile calibrate`'s result: the two costs, their spreads and the provenance."""
    table = Table(title="per-operation framework cost", header_style="bold")
    for column in ("", "seconds", "spread of the fit"):
        table.add_column(column, justify="left" if not column else "right")
    table.add_row("forward, per ATen operation", human_seconds(cost.forward_op_s),
                  f"{cost.spread[0]:.2f}")  # fmt: skip
    table.add_row("backward, per autograd node", human_seconds(cost.backward_node_s),
                  f"{cost.spread[1]:.2f}")  # fmt: skip
    table.add_row("backward, per ATen operation", human_seconds(cost.backward_op_s),
                  f"{cost.spread[2]:.2f}")  # fmt: skip
    where = f"cached in {cost.cache_path}" if cost.cache_path else "not cached"
    table.caption = (
        f"{cost.device}, {_threads(cost.num_threads)}, torch {cost.torch_version}, "
        f"host {cost.host}, measured {cost.measured_at}; chains of "
        f"{', '.join(map(str, cost.chain_lengths))} operations, {cost.repeats} repeats; {where}"
    )
    return table


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"
