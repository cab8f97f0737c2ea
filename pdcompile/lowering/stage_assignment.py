"""Which stage computes each node: a plan read against the graph, checked before code generation.

`assign_nodes` maps every graph node to the stage the plan puts it in (expanding the layers of a
plan made on a coarsened CostGraph) and `check_stage_order` rejects plans whose stages are not
convex, whose stage graph has a cycle, or whose stages are out of pipeline order, naming the
nodes at fault. `pin_nodes` then places what the plan cannot choose freely: graph inputs in
stage 0, the output in the last stage, and `getitem`s that pick tensors out of a tuple with the
node that made the tuple (so tuples never cross a stage boundary).
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable, Mapping

import networkx as nx
import torch.fx as fx

from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import CodegenError
from pdcompile.graph.mutation import written_input
from pdcompile.lowering.stage_values import ValueInfo
from pdcompile.passes.planning.plans import Plan

_SHOWN = 8  # names listed in an error before "... and N more"


def _names(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def assign_nodes(
    gm: fx.GraphModule, plan: Plan, cost_graph: CostGraph | None = None
) -> dict[str, int]:
    """Node name -> stage index, for every node of `gm`, from `plan`.

    Args:
        gm: the captured graph.
        plan: stages in pipeline order, naming graph nodes (or, with `cost_graph`, its nodes).
        cost_graph: the CostGraph the plan was made on; its nodes' `members` (the graph nodes
            a coarsened layer holds) are expanded. Without it the plan must name graph nodes.

    Raises:
        CodegenError: no stages, stage indices out of order, or a node named by no stage, by
            several, or unknown to the graph.
    """
    if not plan.stages:
        raise CodegenError("the plan has no stages; make one with pdcompile.plan")
    for position, stage in enumerate(plan.stages):
        if stage.index != position:
            raise CodegenError(
                f"plan stage {position} has index {stage.index}: stages must be listed in "
                "pipeline order with indices 0, 1, 2, ..."
            )
    known = {node.name for node in gm.graph.nodes}
    stage_of: dict[str, int] = {}
    repeated: dict[str, list[int]] = {}
    unknown: list[str] = []
    for stage in plan.stages:
        for name in stage.nodes:
            members = (name,)
            if cost_graph is not None and name in cost_graph.graph:
                members = cost_graph.graph.nodes[name]["members"]
            for member in members:
                if member not in known:
                    unknown.append(member)
                elif member in stage_of:
                    repeated.setdefault(member, [stage_of[member]]).append(stage.index)
                else:
                    stage_of[member] = stage.index
    if unknown:
        how = (
            "plan on the CostGraph of this graph (pdcompile.analyze(gm, ...)) and pass that "
            "plan; a plan on a coarsened CostGraph names layers: pass cost_graph= as well "
            "(--costs on the command line)"
        )
        if cost_graph is not None:
            how = "the plan and cost_graph come from another graph: plan on this graph's costs"
        raise CodegenError(
            f"the plan names {len(unknown)} node(s) that are not in the graph of "
            f"{type(gm).__name__}: {_names(unknown)}; {how}"
        )
    if repeated:
        where = [f"{name} (stages {', '.join(map(str, s))})" for name, s in repeated.items()]
        raise CodegenError(
            f"{len(repeated)} node(s) are in several stages: {_names(where)}; every node "
            "belongs to exactly one stage"
        )
    missing = [node.name for node in gm.graph.nodes if node.name not in stage_of]
    if missing:
        raise CodegenError(
            f"{len(missing)} node(s) of the graph are in no stage: {_names(missing)}; every node "
            "belongs to exactly one stage (plans from pdcompile.plan on this graph's CostGraph "
            "cover them all)"
        )
    return stage_of


def check_stage_order(gm: fx.GraphModule, stage_of: Mapping[str, int]) -> None:
    """Accept only plans whose every edge goes from a stage to itself or to a later stage.

    That holds exactly when every stage is convex (no path leaves a stage and comes back), the
    stage graph is acyclic and the stages are numbered in pipeline order; the error says which
    of the three fails and names the nodes.

    Raises:
        CodegenError: a stage is not convex, the stages form a cycle, or a stage feeds an
            earlier one.
    """
    nodes = list(gm.graph.nodes)
    backward = [
        (arg, node)
        for node in nodes
        for arg in node.all_input_nodes
        if stage_of[arg.name] > stage_of[node.name]
    ]
    if not backward:
        return
    for stage in sorted({stage_of[n.name] for n in nodes}):
        path = _path_out_and_back(nodes, stage_of, stage)
        if path:
            hops = " -> ".join(f"{n.name} (stage {stage_of[n.name]})" for n in path)
            raise CodegenError(
                f"stage {stage} is not convex: the path {hops} leaves it and comes back. A "
                f"stage must hold every node on a path between two of its nodes: move "
                f"{_names(n.name for n in path[1:-1])} into stage {stage}, or the ends out of it"
            )
    quotient = nx.DiGraph()  # the stage graph, with one example node edge per stage edge
    for node in nodes:
        for arg in node.all_input_nodes:
            a, b = stage_of[arg.name], stage_of[node.name]
            if a != b and not quotient.has_edge(a, b):
                quotient.add_edge(a, b, example=(arg.name, node.name))
    try:
        cycle = nx.find_cycle(quotient)
    except nx.NetworkXNoCycle:
        arg, node = backward[0]
        raise CodegenError(
            f"stage {stage_of[arg.name]} feeds the earlier stage {stage_of[node.name]} (node "
            f"{arg.name} -> {node.name}): stages must be numbered in pipeline order, each "
            "taking values only from earlier stages"
        ) from None
    hops = ", ".join(
        f"stage {a} -> {b} ({quotient.edges[a, b]['example'][0]} -> "
        f"{quotient.edges[a, b]['example'][1]})"
        for a, b in cycle
    )
    raise CodegenError(
        f"the stages form a cycle: {hops}; a pipeline needs an acyclic stage graph. Cut a "
        "topological order of the graph into contiguous pieces, or plan with pdcompile.plan"
    )


def _path_out_and_back(
    nodes: list[fx.Node], stage_of: Mapping[str, int], stage: int
) -> list[fx.Node] | None:
    """A path that starts in `stage`, leaves it and comes back, or None (breadth first)."""
    parent: dict[fx.Node, fx.Node] = {}
    queue: deque[fx.Node] = deque()
    for node in nodes:
        if stage_of[node.name] == stage:
            for user in node.users:
                if stage_of[user.name] != stage and user not in parent:
                    parent[user] = node
                    queue.append(user)
    while queue:
        node = queue.popleft()
        for user in node.users:
            if stage_of[user.name] == stage:
                path = [user, node]
                while stage_of[path[-1].name] != stage:
                    path.append(parent[path[-1]])
                return path[::-1]
            if user not in parent:
                parent[user] = node
                queue.append(user)
    return None


def pin_nodes(
    gm: fx.GraphModule,
    stage_of: Mapping[str, int],
    values: Mapping[str, ValueInfo],
    num_stages: int,
) -> dict[str, int]:
    """The stage of every node as code generation places it.

    Graph inputs go to stage 0 (which takes the model's inputs and forwards what later stages
    need) and the output to the last stage. So that only tensors and small metadata cross
    stage boundaries, a `getitem` or `getattr` picking a value out of a tuple, list, dict or
    output object holding tensors joins the stage that made the container (when its other
    inputs come from no later stage), and a container the output returns joins the last stage.
    A buffer update joins the stage using the buffer. Every other node stays where the plan
    put it.
    The result keeps edges going forward.
    """
    last = num_stages - 1
    pinned = dict(stage_of)
    output = gm.graph.output_node()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            pinned[node.name] = 0
        elif node.op == "output":
            pinned[node.name] = last
        elif node.op == "call_function" and node.target in (operator.getitem, getattr):
            source = node.args[0]
            if not isinstance(source, fx.Node) or values[source.name].kind != "container":
                continue
            home = pinned[source.name]
            if all(pinned[arg.name] <= home for arg in node.all_input_nodes):
                pinned[node.name] = home
        elif not node.users and node.op == "call_function":
            _pin_state_update(node, pinned)
        elif list(node.users) == [output] and values[node.name].kind == "container":
            pinned[node.name] = last  # builds what the model returns (a ModelOutput)
    return pinned


def _pin_state_update(node: fx.Node, pinned: dict[str, int]) -> None:
    """A write into a parameter or buffer (a BatchNorm statistic's `copy_`) joins the stage of
    the tensor's other user, where its new value is computed."""
    target = written_input(node)
    if not isinstance(target, fx.Node) or target.op != "get_attr":
        return
    others = [pinned[u.name] for u in target.users if u is not node]
    computed = [pinned[a.name] for a in node.all_input_nodes if a.op != "get_attr"]
    if others and all(stage <= min(others) for stage in computed):
        pinned[node.name] = min(others)
