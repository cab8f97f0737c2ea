"""More stages from a plan's: a chunked plan needs exactly ranks x chunks stages, and a solver
that balances the bottleneck may use fewer (a heavy node bounds every cut, so more stages do
not help it). Splitting a stage never lengthens the bottleneck's compute. Torch-free."""

from __future__ import annotations

from pdcompile.core.cost_graph import CostGraph
from pdcompile.passes.planning.plans import Plan, Stage


def split_to(plan: Plan, count: int, cost_graph: CostGraph) -> Plan:
    """`plan` with `count` stages of one replica on ranks 0.. in order: the stage with the most
    compute (of those with two or more nodes) is cut where its halves are most even, until
    there are `count`. A stage's nodes are a run of a topological order, so both halves are.
    The plan is not priced (`evaluation.price` prices it). Fewer nodes than `count`: as many
    stages as nodes."""
    groups = [list(s.nodes) for s in plan.stages]
    times = dict(zip(cost_graph.nodes, cost_graph.compute_times(), strict=True))
    while len(groups) < count:
        splittable = [i for i, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda j: sum(times[n] for n in groups[j]))
        groups[i : i + 1] = _halves(groups[i], times)
    stages = tuple(
        Stage(index=i, nodes=tuple(nodes), replicas=1, ranks=(i,)) for i, nodes in enumerate(groups)
    )
    return plan.with_(stages=stages)


def _halves(nodes: list[str], times: dict[str, float]) -> list[list[str]]:
    """`nodes` cut after the prefix whose compute is closest to half (both sides non-empty)."""
    total, run, best, cut = sum(times[n] for n in nodes), 0.0, None, 1
    for k in range(1, len(nodes)):
        run += times[nodes[k - 1]]
        worse = max(run, total - run)
        if best is None or worse < best:
            best, cut = worse, k
    return [nodes[:cut], nodes[cut:]]
