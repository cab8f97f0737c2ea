"""Put a captured graph in a canonical order with canonical names, the same in every process.

The order in which a model's Python runs independent computations can depend on per-process
state: Gemma3's `for layer_type in set(self.config.layer_types)` computes its two rotary tables in
the order of the strings' hashes, which differ with `PYTHONHASHSEED`. The captured graph then
lists the same nodes in another order, under other names, and ranks of one job disagree on it.

`canonicalize` rebuilds the graph in an order that depends only on its data flow: the inputs in
call order, then a depth-first walk from the output through each node's arguments in argument
order (a node comes right before its first use). Constraints that data flow does not show are
kept as extra dependencies: random operations stay in their original relative order (they draw
from one generator), a write into a buffer stays after the reads before it and before the reads
after it. Nodes without users (assertions, buffer updates) follow their latest input. Nodes
named after what they call (`linear_3`) are numbered again in the new order; placeholders,
`get_attr` and `call_module` nodes keep their names, which come from the model's own names.
"""

from __future__ import annotations

import copy
import re

import torch
import torch.fx as fx

from pdcompile.graph.mutation import written_input

_NUMBERED = re.compile(r"^(.*?)(?:_\d+)?$")
_RANDOM_NAMES = ("dropout", "rand", "bernoulli", "multinomial", "normal", "uniform", "exponential")


def canonicalize(gm: fx.GraphModule) -> None:
    """Rebuild `gm.graph` in canonical order and names (in place; meta travels with each node)."""
    old = gm.graph
    nodes = list(old.nodes)
    deps = _dependencies(gm, nodes)
    order = _order(nodes, deps)
    names = _names(order)
    if order == nodes and all(n.name == name for n, name in zip(order, names, strict=True)):
        return
    graph = fx.Graph(owning_module=gm, tracer_cls=old._tracer_cls,
                     tracer_extras=old._tracer_extras)  # fmt: skip
    graph._codegen = old._codegen  # the old graph is dropped: its output spec moves over
    env: dict[fx.Node, fx.Node] = {}
    for node, name in zip(order, names, strict=True):
        new = graph.create_node(node.op, node.target, fx.map_arg(node.args, env.__getitem__),
                                fx.map_arg(node.kwargs, env.__getitem__), name=name,
                                type_expr=node.type)  # fmt: skip
        new.meta = copy.copy(node.meta)
        env[node] = new
    gm.graph = graph  # recompiles
    graph.lint()


def _is_random(node: fx.Node) -> bool:
    """Whether `node` draws from a random generator (its place among such nodes matters)."""
    if isinstance(node.target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in node.target.tags
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return any(part in name.lower() for part in _RANDOM_NAMES)


def _dependencies(gm: fx.GraphModule, nodes: list[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """Each node's inputs, in argument order, plus the orderings data flow does not show."""
    deps = {node: list(node.all_input_nodes) for node in nodes}
    position = {node: i for i, node in enumerate(nodes)}
    last_random: fx.Node | None = None
    for node in nodes:
        if _is_random(node):
            if last_random is not None:
                deps[node].append(last_random)
            last_random = node
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        target = written_input(node, module)
        if isinstance(target, fx.Node):  # after the reads before it, before the reads after it
            for reader in target.users:
                if reader is node:
                    continue
                if position[reader] < position[node]:
                    deps[node].append(reader)
                else:
                    deps[reader].append(node)
    return deps


def _order(nodes: list[fx.Node], deps: dict[fx.Node, list[fx.Node]]) -> list[fx.Node]:
    """Placeholders, then a post-order walk from the output, each node the walk does not reach
    (it has no users) right after its latest input, and the output."""
    walked: list[fx.Node] = [n for n in nodes if n.op == "placeholder"]
    done = set(walked)
    output = [n for n in nodes if n.op == "output"]
    stack: list[tuple[fx.Node, int]] = [(root, 0) for root in output]
    while stack:  # iterative: graphs of many thousand nodes
        node, i = stack.pop()
        if node in done:
            continue
        if i < len(deps[node]):
            stack.append((node, i + 1))
            if deps[node][i] not in done:
                stack.append((deps[node][i], 0))
            continue
        done.add(node)
        walked.append(node)
    rank: dict[fx.Node, tuple[int, ...]] = {
        n: (i,) for i, n in enumerate(walked) if n.op != "output"
    }
    hung: dict[fx.Node | None, list[fx.Node]] = {}
    for node in nodes:  # in graph order: a hung node's hung inputs come first
        if node in done:
            continue
        anchor = max(deps[node], key=rank.__getitem__, default=None)
        hung.setdefault(anchor, []).append(node)
        rank[node] = (*rank[anchor], len(hung[anchor])) if anchor is not None else (-1,)
    order: list[fx.Node] = []

    def emit(node: fx.Node) -> None:
        order.append(node)
        for side in hung.get(node, ()):
            emit(side)

    inputs = [n for n in walked if n.op == "placeholder"]
    order.extend(inputs)
    for node in [None, *inputs]:  # what hangs below no node or an input: after the inputs
        for side in hung.pop(node, ()):
            emit(side)
    for node in walked[len(inputs) :]:
        if node.op != "output":
            emit(node)
    return order + output


def _names(order: list[fx.Node]) -> list[str]:
    """Names in order: kept for inputs, attributes and modules, numbered per base otherwise."""
    kept = {n.name for n in order if n.op in ("placeholder", "get_attr", "call_module", "output")}
    taken = set(kept)
    count: dict[str, int] = {}
    names = []
    for node in order:
        if node.name in kept and node.op != "call_function" and node.op != "call_method":
            names.append(node.name)
            continue
        base = _NUMBERED.match(node.name).group(1) or node.op
        while True:
            n = count.get(base, 0)
            count[base] = n + 1
            name = base if n == 0 else f"{base}_{n}"
            if name not in taken:
                break
        taken.add(name)
        names.append(name)
    return names
