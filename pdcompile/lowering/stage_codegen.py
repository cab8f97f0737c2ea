"""`pdcompile.lowering`: cut a captured graph into one GraphModule per stage of a plan.

The lowering, top to bottom (docs/codegen.md has the details):

1. `assign_nodes`: every graph node in exactly one stage (a coarsened plan's layers expanded).
2. `check_stage_order`: stages convex, stage graph acyclic, stages in pipeline order.
3. `describe_values`: run the graph at a second batch size: kinds of values, symbolic shapes.
4. `pin_nodes`: inputs to stage 0, output to the last stage, tuple `getitem`s to their tuple.
5. `_check_writes`: an in-place write's target is used by one stage only.
6. `_route_values`: channels (once per destination, straight from the producer), constants.
7. `_hold_tensors`: which stages hold which parameters and buffers; tie groups.
8. `_build_stage`: copy each stage's nodes into its own graph (`Graph.node_copy`) and module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch.fx.graph import _PyTreeCodeGen

from pdcompile.capture.graph_module import CapturedGraphModule
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import CodegenError
from pdcompile.core.ir import CONSTANTS, PARAM_TABLE, TRAINING, ParamInfo
from pdcompile.graph.mutation import written_input
from pdcompile.graph.node_runner import COMPUTE_OPS
from pdcompile.lowering.stage_assignment import assign_nodes, check_stage_order, pin_nodes
from pdcompile.lowering.stage_modules import (
    TreeOutputCodeGen,
    assemble_root,
    copy_tensor,
    fetch,
    finish_state,
    non_persistent,
)
from pdcompile.lowering.stage_values import ValueInfo, describe_values
from pdcompile.lowering.staged_program import Channel, StagedProgram, StageSignature, TieGroup
from pdcompile.passes.planning.plans import Plan


@dataclass
class _Routes:
    """Per stage: the values it receives and sends (graph order) and constants written in."""

    channels: list[Channel] = field(default_factory=list)
    inputs: list[list[str]] = field(default_factory=list)
    outputs: list[list[str]] = field(default_factory=list)
    constants: list[dict[str, Any]] = field(default_factory=list)


def codegen(
    gm: fx.GraphModule, plan: Plan, *, cost_graph: CostGraph | None = None
) -> StagedProgram:
    """Generate one module per stage of `plan`, exact to the captured graph.

    Args:
        gm: a graph from `pdcompile.trace` (it is run once more, with its state restored).
        plan: stages in pipeline order naming the graph's nodes (`pdcompile.plan` on the
            CostGraph of `gm`).
        cost_graph: the CostGraph the plan was made on, needed when it was coarsened: the
            `members` of the layers the plan names are expanded into graph nodes.

    Returns:
        The StagedProgram: `program(*inputs)` returns what `gm(*inputs)` returns.

    Raises:
        CodegenError: the plan names unknown nodes, misses or repeats nodes, has a non-convex
            stage, a cycle or stages out of order (all checked before any code is generated);
            a value that cannot cross a stage boundary would have to (naming the nodes).

    Example:
        >>> model, inputs = pdcompile.zoo.gpt()
        >>> gm = pdcompile.trace(model.eval(), inputs)
        >>> costs = pdcompile.analyze(gm, inputs, profile=False)
        >>> program = pdcompile.codegen(gm, pdcompile.plan(costs, pdcompile.Cluster.parse("2")))
        >>> program.ties
        (TieGroup(names=('wte.weight', 'lm_head.weight'), owner=0, stages=(0, 1)),)
    """
    if PARAM_TABLE not in gm.meta:
        raise CodegenError(
            f"{type(gm).__name__} has no parameter table; code generation needs a graph from "
            "pdcompile.trace"
        )
    num_stages = len(plan.stages)
    stage_of = assign_nodes(gm, plan, cost_graph)
    check_stage_order(gm, stage_of)
    values = describe_values(gm)
    pinned = pin_nodes(gm, stage_of, values, num_stages)
    _check_writes(gm, pinned)
    routes = _route_values(gm, pinned, values, num_stages)
    held, ties = _hold_tensors(gm, pinned, num_stages)
    stages = [
        _build_stage(gm, index, num_stages, pinned, routes, held[index], ties)
        for index in range(num_stages)
    ]
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    signatures = [
        StageSignature(
            index,
            tuple(p.name for p in placeholders) if index == 0 else tuple(routes.inputs[index]),
            tuple(routes.outputs[index]),
            tuple(
                n.name for n in gm.graph.nodes if n.op in COMPUTE_OPS and pinned[n.name] == index
            ),
            tuple(name for info in held[index] for name in info.names),
        )
        for index in range(num_stages)
    ]
    input_specs = {p.name: values[p.name].describe() for p in placeholders}
    return StagedProgram(
        stages, signatures, routes.channels, ties, plan=plan, input_specs=input_specs,
        model_name=type(gm).__name__, training=bool(gm.meta.get(TRAINING, gm.training)),
        constants=gm.meta.get(CONSTANTS, ()),
    )  # fmt: skip


def _written(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The graph value `node` writes into in place, if any."""
    if node.op not in COMPUTE_OPS:
        return None
    module = gm.get_submodule(node.target) if node.op == "call_module" else None
    target = written_input(node, module)
    return target if isinstance(target, fx.Node) else None


def _check_writes(gm: fx.GraphModule, pinned: Mapping[str, int]) -> None:
    """An in-place write must happen in the one stage that uses its target.

    Each stage gets its own copy of a value it receives, so a write into a value other stages
    also use would be seen by some of them only (the in-process program would hide that).
    """
    for node in gm.graph.nodes:
        target = _written(gm, node)
        if target is None:
            continue
        stages = sorted({pinned[user.name] for user in target.users})
        if len(stages) > 1:
            raise CodegenError(
                f"node {node.name} (stage {pinned[node.name]}) writes into {target.name} in "
                f"place, which stages {stages} use: each stage would see its own copy. Keep "
                f"the users of {target.name} in one stage, or make the operation out of place "
                "(e.g. inplace=False)"
            )


def _route_values(
    gm: fx.GraphModule,
    pinned: Mapping[str, int],
    values: Mapping[str, ValueInfo],
    num_stages: int,
) -> _Routes:
    """Channels from each value's producer straight to every later stage that uses it.

    Parameters and buffers (`get_attr`) never travel: each stage reads its own. Constant
    metadata is written into the consumer's code instead of being sent.

    Raises:
        CodegenError: a container of tensors or an object would cross a stage boundary.
    """
    order = {node.name: i for i, node in enumerate(gm.graph.nodes)}
    routes = _Routes(constants=[{} for _ in range(num_stages)])
    sent: set[tuple[int, int, str]] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        dst = pinned[node.name]
        for arg in node.all_input_nodes:
            src = pinned[arg.name]
            if arg.op == "get_attr" or src == dst:
                continue
            info = values[arg.name]
            if info.constant:
                routes.constants[dst][arg.name] = info.literal
            elif info.kind in ("tensor", "value"):
                sent.add((src, dst, arg.name))
            else:
                what = " holding tensors" if info.kind == "container" else ""
                raise CodegenError(
                    f"node {arg.name} (stage {src}) makes a {info.type_name}{what}, which node "
                    f"{node.name} in stage {dst} uses: only tensors and small metadata (numbers, "
                    f"shapes, dtypes, devices) cross stage boundaries. Put {arg.name} and "
                    f"{node.name} in one stage"
                )
    for src, dst, name in sorted(sent, key=lambda s: (s[0], s[1], order[s[2]])):
        info = values[name]
        routes.channels.append(
            Channel(src, dst, name, info.kind, info.shape, info.dtype, info.requires_grad,
                    "" if info.kind == "tensor" else info.type_name)
        )  # fmt: skip
    for stage in range(num_stages):
        by_order = sorted({c.name for c in routes.channels if c.dst_stage == stage}, key=order.get)
        routes.inputs.append(by_order)
        by_order = sorted({c.name for c in routes.channels if c.src_stage == stage}, key=order.get)
        routes.outputs.append(by_order)
    return routes


def _hold_tensors(
    gm: fx.GraphModule, pinned: Mapping[str, int], num_stages: int
) -> tuple[list[list[ParamInfo]], list[TieGroup]]:
    """Per stage, the parameters and buffers its nodes use; tensors used by several are tied.

    The owner of a tie group is the stage of the tensor's first user (where the cost model
    charges it). Tensors the forward pass never uses go to stage 0, so the stages' state dicts
    together hold the whole model.
    """
    held: list[list[ParamInfo]] = [[] for _ in range(num_stages)]
    ties = []
    for info in gm.meta[PARAM_TABLE]:
        users = [pinned[user] for user in info.users]
        stages = sorted(set(users)) or [0]
        for stage in stages:
            held[stage].append(info)
        if len(stages) > 1:
            ties.append(TieGroup(info.names, users[0], tuple(stages)))
    return held, ties


def _build_stage(
    gm: fx.GraphModule,
    index: int,
    num_stages: int,
    pinned: Mapping[str, int],
    routes: _Routes,
    held: Sequence[ParamInfo],
    ties: Sequence[TieGroup],
) -> CapturedGraphModule:
    """Copy stage `index`'s nodes into a graph of their own and wrap them in a module."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    by_name = {node.name: node for node in gm.graph.nodes}
    if index == 0:
        for node in gm.graph.find_nodes(op="placeholder"):
            env[node] = graph.node_copy(node)
    else:
        written = {w.name for n in gm.graph.nodes if pinned.get(n.name) == index
                   if (w := _written(gm, n)) is not None}  # fmt: skip
        for name in routes.inputs[index]:
            env[by_name[name]] = graph.placeholder(name)
            if name in written:  # a received tensor is a leaf: write into a copy of it
                env[by_name[name]] = graph.call_method("clone", (env[by_name[name]],))
    for name, literal in routes.constants[index].items():
        env[by_name[name]] = literal
    last = index == num_stages - 1
    for node in gm.graph.nodes:
        mine = node.op in COMPUTE_OPS or (node.op == "output" and last)
        if not mine or pinned[node.name] != index:
            continue
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:  # each stage reads its own tensors
                env[arg] = graph.node_copy(arg)
        env[node] = graph.node_copy(node, env.__getitem__)
    if last:
        codegen = gm.graph._codegen
        if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info.out_spec is not None:
            graph._codegen = TreeOutputCodeGen(codegen.pytree_info.out_spec)
    else:
        graph.output({name: env[by_name[name]] for name in routes.outputs[index]})
    for node in graph.nodes:
        node.type = None  # annotations only; they would need imports in the written source
    graph.lint()

    tensors = [fetch(gm, info.name) for info in held]
    copied = {name for tie in ties if index in tie.copies for name in tie.names}
    replace = {id(t): copy_tensor(t) for info, t in zip(held, tensors, strict=True)
               if info.name in copied}  # fmt: skip
    root = assemble_root(graph, lambda target: fetch(gm, target), replace)
    training = bool(gm.meta.get(TRAINING, gm.training))
    stage = CapturedGraphModule(root, graph, f"{type(gm).__name__}Stage{index}", training)
    if index == 0:
        stage.bind_constants(gm.meta.get(CONSTANTS, ()))
    state = [(info.names, replace.get(id(t), t)) for info, t in zip(held, tensors, strict=True)]
    finish_state(stage, state, non_persistent(gm))
    return stage
