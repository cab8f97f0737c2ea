"""What a solver needs and nothing of the planner: the solver registry (`register_solver`,
`solvers`) and `make_plan`. Torch-free.

A solver is a pure function `fn(cost_graph, cluster, options: dict) -> Plan` in a file of the
`solvers` package (found by listing it). `options` holds the caller's solver options plus
`schedule` (the `PipelineSchedule`) and `num_microbatches`. Solvers price stages with the cost
model (`cost_model`) and build their plan with `make_plan`, which places stages on consecutive
ranks and prices them with the cost model (`evaluation.price`), so every solver is compared on
the same yardstick; `plan()` (`planner`) searches around them and simulates the plan it returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from pdcompile.core.cluster import Cluster
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError
from pdcompile.core.registry import Registry
from pdcompile.passes.planning.cost_model import Pricing
from pdcompile.passes.planning.evaluation import price
from pdcompile.passes.planning.plans import RENAMED_SOLVERS, Plan, Stage, consecutive_ranks
from pdcompile.scheduling import PipelineSchedule

Solver = Callable[[CostGraph, Cluster, dict[str, Any]], Plan]
# options `plan()` adds for every solver: the schedule, the microbatches searched with, the
# replica counts allowed (absent: all; the caller's `replica_counts` or microbatch count may rule
# some out), and whether plan() chooses the count (`settled_microbatches` may then round it up)
SEARCH = ("schedule", "num_microbatches", "replica_counts", "even_microbatches")
SOLVERS: Registry[Solver] = Registry(
    "solver",
    (
        "pdcompile.passes.planning.solvers.baselines",
        "pdcompile.passes.planning.solvers.dp",
        "pdcompile.passes.planning.solvers.pipedream",
        "pdcompile.passes.planning.solvers.ideal",
        "pdcompile.passes.planning.solvers.cpsat",
    ),
    PartitionError,
    aliases=dict(RENAMED_SOLVERS),
)


def register_solver(name: str) -> Callable[[Solver], Solver]:
    """Register `fn(cost_graph, cluster, options) -> Plan` under `name` (its docstring's first
    line is its description in `solvers()` and `pdcompile solvers`)."""

    def decorate(fn: Solver) -> Solver:
        SOLVERS.add(name, fn)
        return fn

    return decorate


def solvers() -> dict[str, str]:
    """Registered solver names -> one-line descriptions."""
    return SOLVERS.describe()


def make_plan(
    cost_graph: CostGraph,
    cluster: Cluster | str | int,
    groups: Sequence[tuple[Sequence[str], int]],
    options: dict[str, Any],
    solver: str,
) -> Plan:
    """A plan from `(nodes, replicas)` per stage in pipeline order, on consecutive ranks,
    priced (`evaluation.price`; `plan()` simulates the one it returns) at the microbatch count
    `settled_microbatches` gives from `options["num_microbatches"]` (`plan()` refuses a count
    the caller gave that the schedule does not accept)."""
    cluster, rules, _, _ = Pricing.of(cluster, options)
    ranks = consecutive_ranks([r for _, r in groups])
    if ranks and ranks[-1] and ranks[-1][-1] >= cluster.num_devices:
        raise PartitionError(
            f"{solver}: the stages need {ranks[-1][-1] + 1} devices, the cluster has "
            f"{cluster.num_devices}"
        )
    stages = tuple(
        Stage(index=i, nodes=tuple(nodes), replicas=r, ranks=ranks[i])
        for i, (nodes, r) in enumerate(groups)
    )
    m = settled_microbatches(
        rules, [r for _, r in groups], options["num_microbatches"],
        even=options.get("even_microbatches", False),
    )  # fmt: skip
    skeleton = Plan(
        stages=stages,
        cluster=cluster,
        schedule=rules.name,
        num_microbatches=m,
        microbatch_size=cost_graph.batch_size,
        solver=solver,
        options={k: v for k, v in options.items() if k not in SEARCH},
    )
    return price(skeleton, cost_graph, rules=rules)


def settled_microbatches(
    rules: PipelineSchedule, replicas: Sequence[int], at_least: int, *, even: bool = False
) -> int:
    """The microbatch count a plan with stages of `replicas` runs: the first from `at_least` on
    that the schedule accepts. With `even` (`plan()` chooses the count), the first of those
    that every replica count divides, if it is less than one round of the largest count
    further: then every replica of a stage runs as many microbatches (replica k mod r runs
    microbatch k, so 8 over 3 replicas split 3/3/2 and the third idles; 9 split 3/3/3). Past
    that the split stays uneven, and `plan()` warns.

    >>> from pdcompile.scheduling import get_schedule
    >>> settled_microbatches(get_schedule("1f1b"), [1, 3], 8, even=True)
    9
    """
    m = rules.accepted_microbatches(replicas, at_least)
    if not even or all(m % r == 0 for r in replicas):
        return m
    step = math.lcm(*replicas)
    limit = m + max(replicas)
    even_m = -(-m // step) * step
    while even_m < limit and not rules.accepts(replicas, even_m):
        even_m += step
    return even_m if even_m < limit else m
