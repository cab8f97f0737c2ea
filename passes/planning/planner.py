"""`pdcompile.plan`: the searches (schedule, microbatch count, recomputation, chunks) around a
solver of `solver_kit`'s registry, and the simulation of the plan it returns. Torch-free."""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

from pdcompile.core.cluster import AUTO, Cluster
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError, PlanConfigError, PlanWarning, ScheduleError
from pdcompile.core.progress import phase
from pdcompile.passes.planning.evaluation import price, simulated
from pdcompile.passes.planning.microbatch_count import plan_microbatches
from pdcompile.passes.planning.order_search import plan_orders
from pdcompile.passes.planning.plan_config import PlanConfig, Planner
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.recompute_choice import limited, plan_recompute
from pdcompile.passes.planning.schedule_choice import plan_auto
from pdcompile.passes.planning.solver_kit import SOLVERS
from pdcompile.passes.planning.stage_split import split_to
from pdcompile.scheduling import PipelineSchedule
from pdcompile.scheduling.base import MAX_MICROBATCHES

CHUNK_TRIES = 4  # cuts of a chunked plan under a memory limit, bisecting the stage budget


def plan(
    cost_graph: CostGraph,
    cluster: Cluster | str | int | None = None,
    *,
    config: PlanConfig | None = None,
    **options: Any,
) -> Plan:
    """Cut `cost_graph` into pipeline stages with replica counts for `cluster`.

    Args:
        cost_graph: costs per node (from `analyze`, `CostGraph.load` or `from_pipedream`).
        cluster: the devices: a `Cluster`, its text (e.g. "8@300GB/s,2@25Gbit/s") or a number
            of devices (`Cluster.coerce`); with `config`, its own.
        config: the settings (`PlanConfig`), instead of `options`.
        options: `PlanConfig`'s fields, each documented there: `solver`, `schedule` (or
            "auto"), `num_microbatches`, `microbatch_size`, `replica_counts`, `chunks`,
            `allow_async`, `global_batch_size`, `memory`, `recompute`; any other keyword is
            the solver's own option.

    Returns:
        The Plan, with `solve_time_s` set.

    Warns:
        PlanWarning: a stage's replicas run different numbers of microbatches per step (the
            microbatch count is not a multiple of its replica count): the message gives the
            split, what the short replicas idle and the way out (`Plan.uneven_splits`; the
            same text closes `str(plan)`).

    Raises:
        ConfigError: (a `PartitionError` too) a bad setting: unknown solver or schedule,
            `cluster` is no cluster, a count out of range.
        PartitionError: bad `replica_counts` for the cluster, a plan whose simulation would
            exceed `runtime.simulator.MAX_ACTIONS` or whose figures no plan file holds, or no
            plan exists (the message says why).
    """
    config = planning_config(cluster, config, options)
    nodes = cost_graph.graph.number_of_nodes()
    with phase(f"planning {nodes} nodes on {config.cluster.num_devices} devices"):
        result = _layered(SEARCHES)(cost_graph, config)
    for split in result.uneven_splits:
        warnings.warn(PlanWarning(result.uneven_note(split)), stacklevel=2)
    return result


def _layered(searches: tuple[Callable[..., Plan], ...]) -> Planner:
    """`searches` as layers, the first outermost: each plans through the next, the solver's
    plan (`_solved`) innermost."""
    planner: Planner = _solved
    for search in reversed(searches):
        planner = functools.partial(search, planner)
    return planner


def planning_config(
    cluster: Cluster | str | int | None, config: PlanConfig | None, options: dict[str, Any]
) -> PlanConfig:
    """`plan()`'s settings: `config` as given, else `cluster` and `options` (a `PlanConfig`'s
    fields, the rest the solver's options), checked.

    Raises:
        ConfigError: both forms, or a bad setting (as `PlanConfig`), or no cluster.
    """
    if config is None:
        fields = {f.name for f in dataclasses.fields(PlanConfig)}
        solver_options = {k: v for k, v in options.items() if k not in fields}
        settings = {k: v for k, v in options.items() if k in fields}
        if cluster is None or cluster == AUTO:  # a job measures it; plan() cannot
            try:
                Cluster.coerce(cluster)
            except PartitionError as exc:
                raise PlanConfigError(str(exc)) from None
        config = PlanConfig(cluster=cluster, **settings, solver_options=solver_options)
    elif cluster is not None or options:
        raise PlanConfigError(
            f"give plan() its settings either as config= or as keywords, not both: got "
            f"config= and {['cluster'] * (cluster is not None) + sorted(options)}"
        )
    if config.cluster is None:
        raise PlanConfigError("plan() needs a cluster: PlanConfig(cluster=...) is None")
    if config.memory is not None:  # the layers read the limit off the cluster
        config = config.replace(cluster=limited(config.cluster, config.memory), memory=None)
    return config


def plan_chunks(inner: Planner, cost_graph: CostGraph, config: PlanConfig) -> Plan:
    """With more than one stage per rank (`chunks`, else the schedule's `default_chunks`), the
    plan `_plan_chunks` places, `inner` (the planner's next layer) cutting the stages; else
    `inner`'s plan."""
    rules = config.rules
    chunks = rules.default_chunks if config.chunks is None else config.chunks
    if chunks == 1:
        return inner(cost_graph, config)
    chunked = _plan_chunks(inner, _at_rows(cost_graph, config), config, chunks)
    chunked.to_dict()  # figures no plan file holds raise here, not when it is saved or sent
    return chunked


# the searches, outermost first, each a layer around the next (`_layered`): the schedule, the
# microbatch count, the order fitted to the plan (to its recomputation too), recomputation,
# stages per rank; the solver's plan innermost
SEARCHES = (plan_auto, plan_microbatches, plan_orders, plan_recompute, plan_chunks)


def _at_rows(cost_graph: CostGraph, config: PlanConfig) -> CostGraph:
    """`cost_graph` scaled to `config.microbatch_size` rows (as it is without one)."""
    if config.microbatch_size in (None, cost_graph.batch_size):
        return cost_graph
    return cost_graph.scaled(config.microbatch_size)


def _solved(cost_graph: CostGraph, config: PlanConfig) -> Plan:
    """The solver's plan of one stage per rank on `config.cluster` (its memory limit applied),
    at the microbatch count given or the one `settled_microbatches` settles, simulated."""
    solver, cluster, rules = config.solver, config.cluster, config.rules
    if cost_graph.graph.number_of_nodes() == 0:
        raise PartitionError("the cost graph has no nodes; nothing to plan")
    cost_graph = _at_rows(cost_graph, config)
    # solvers search with twice the devices (within the cap); the count the plan runs is
    # settled after. A count the caller gave limits the replicas to those the schedule accepts
    given = config.num_microbatches
    searched = given or min(2 * cluster.num_devices, MAX_MICROBATCHES)
    options = {**config.solver_options, "schedule": rules, "num_microbatches": searched,
               "even_microbatches": given is None}  # fmt: skip
    allowed = _allowed_replicas(config, rules, searched)
    if allowed != tuple(range(1, cluster.num_devices + 1)):
        options["replica_counts"] = allowed
    start = time.perf_counter()
    result = SOLVERS.get(solver)(cost_graph, cluster, options)
    seconds = time.perf_counter() - start
    _check_solved(result, config, allowed)
    result = simulated(result, rules).with_(solve_time_s=seconds)
    result.to_dict()  # figures no plan file holds raise here, not when it is saved or sent
    return result


def _allowed_replicas(
    config: PlanConfig, rules: PipelineSchedule, searched: int
) -> tuple[int, ...]:
    """The replica counts a stage may have: `replica_counts` (those above the devices drop),
    and with a count given, those the schedule accepts at it; without, those it runs at some
    count from `searched` on.

    Raises:
        PartitionError: none is left.
    """
    counts = tuple(range(1, config.cluster.num_devices + 1))
    allowed = counts
    if config.replica_counts is not None:
        allowed = tuple(r for r in counts if r in set(config.replica_counts))
        if not allowed:
            raise PartitionError(
                f"replica_counts={config.replica_counts}: no stage of a cluster of "
                f"{len(counts)} devices can have that many replicas; add smaller counts (1 "
                "always fits)"
            )
    if config.num_microbatches is not None:
        allowed = tuple(r for r in allowed if rules.accepts([r], searched))
        if not allowed:
            raise PartitionError(
                f"{rules.name} accepts none of replica_counts="
                f"{tuple(config.replica_counts or ())} with {config.num_microbatches} "
                f"microbatches; add 1 or counts dividing {config.num_microbatches}"
            )
    else:  # a count the planner settles: the replica counts the schedule runs at some count
        allowed = tuple(r for r in allowed if _runs_some_count(rules, r, searched))
        if not allowed:
            raise PartitionError(f"{rules.name} runs no stage of 1 to {counts[-1]} replicas")
    return allowed


def _runs_some_count(rules: PipelineSchedule, replicas: int, at_least: int) -> bool:
    """Whether `rules` runs a stage of `replicas` at some count from `at_least` on (a kind of
    fixed orders, such as a loaded CSV, runs one replica per stage only)."""
    try:
        rules.accepted_microbatches([replicas], at_least)
    except ScheduleError:
        return False
    return True


def _check_solved(result: Plan, config: PlanConfig, allowed: tuple[int, ...]) -> None:
    """Refuse a solver's plan that breaks the settings: replicas on a stage holding a tied
    tensor where the schedule does not replicate ties, replica counts outside
    `replica_counts`, or another microbatch count than the one given."""
    solver, rules, given = config.solver, config.rules, config.num_microbatches
    _check_tied_replicas(result, solver, rules)
    if config.replica_counts is not None and any(s.replicas not in allowed for s in result.stages):
        raise PartitionError(
            f"solver {solver!r} gave stages {[s.replicas for s in result.stages]} replicas, "
            f"outside replica_counts={config.replica_counts}; it does not search within them: "
            "use solver 'dynprog', 'ideal' or 'cpsat'"
        )
    if given is not None and result.num_microbatches != given:
        try:  # the schedule's own reason
            rules.check([s.replicas for s in result.stages], given)
        except ScheduleError as exc:
            raise PartitionError(f"solver {solver!r} found {result.num_stages} stages, but "
                                 f"{exc}") from None  # fmt: skip


def _check_tied_replicas(plan: Plan, solver: str, rules: PipelineSchedule) -> None:
    """A schedule that does not replicate ties needs one replica on each stage holding a tied
    tensor's copy (`pipedream`: replicas update once per round of them, so a replicated copy
    would update at another pace)."""
    if rules.replicates_ties:
        return
    for stages, _ in plan.ties:
        for s in stages:
            if plan.stages[s].replicas > 1:
                raise PartitionError(
                    f"solver {solver!r} gave stage {s} {plan.stages[s].replicas} replicas, but it "
                    f"holds a copy of a tensor that stages {list(stages)} share (tied weights): "
                    f"under {rules.name} such a stage needs one replica; use solver 'dynprog', "
                    "which keeps to this, or a schedule that replicates ties (e.g. '2bw')"
                )


def chunk_layout(
    rules: PipelineSchedule, num_ranks: int, chunks: Any, num_microbatches: int | None = None
) -> tuple[list[tuple[int, ...]], int]:
    """The ranks of `num_ranks` x `chunks` stages as `rules` places them (`chunk_rank`), and the
    microbatch count they run: `num_microbatches`, else the first from 2p the layout accepts.

    Raises:
        PartitionError: `chunks` is no integer >= 1, or the schedule does not run that layout
            (with that count).
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise PartitionError(f"chunks must be an integer >= 1 (stages per rank), got {chunks!r}")
    p, count = num_ranks, num_ranks * chunks
    try:
        ranks = [(rules.chunk_rank(i, p, chunks),) for i in range(count)]
        m = num_microbatches or 2 * p
        while True:  # the count the schedule accepts on this layout
            try:
                rules.check([1] * count, m)
                rules.check_layout(ranks, m)
                return ranks, m
            except ScheduleError:
                if num_microbatches is not None or m >= MAX_MICROBATCHES:
                    raise
                m += 1
    except ScheduleError as exc:
        raise PartitionError(f"{rules.name} with chunks={chunks} on {p} ranks: {exc}") from None


def _plan_chunks(inner: Planner, cost_graph: CostGraph, config: PlanConfig, chunks: int) -> Plan:
    """`chunks` stages per rank, one replica each: the solver (`inner`) cuts the graph into
    p x chunks stages as for as many devices, each with 1/chunks of a device's memory, all on the
    cluster's slowest link (a rank's stages are not neighbours); the schedule places them
    (`chunk_rank`), and the plan is priced and simulated on the real cluster at the first
    microbatch count from 2p on (or the one given) its layout accepts. Under a memory limit the
    solver's budget per stage (its 1F1B counts are not the schedule's) is bisected as a share of
    a device, from 1/chunks, over `CHUNK_TRIES` cuts: a plan whose ranks fit in the simulation
    raises it, one that overshoots (or no plan at all) lowers it; the fastest fitting plan is
    returned, else the one overshooting least."""
    cluster = config.cluster
    if cluster.num_devices * chunks > len(cost_graph.nodes):  # before a layout of that size
        raise PartitionError(
            f"chunks={chunks} on {cluster.num_devices} ranks needs "
            f"{cluster.num_devices * chunks} stages, but the graph has too few nodes to cut so "
            f"many ({len(cost_graph.nodes)}); use fewer chunks"
        )
    ranks, m = chunk_layout(config.rules, cluster.num_devices, chunks, config.num_microbatches)
    place = functools.partial(_placed, inner, cost_graph, config.replace(num_microbatches=m), ranks)
    if cluster.memory is None:
        return place(None)
    # the solver's stage budget, as a share of a device: the largest whose plan fits the ranks
    low, high, share = 0.0, 2.0, 1 / chunks
    fitting: Plan | None = None
    over: Plan | None = None
    failure: PartitionError | None = None
    for _ in range(CHUNK_TRIES):
        try:
            result = place(share * cluster.memory)
        except PartitionError as exc:  # nothing fits so small a budget
            failure, low = failure or exc, share
        else:
            if result.fits_memory:
                low = share
                if fitting is None or result.step_time < fitting.step_time:
                    fitting = result
            else:
                high = share
                if over is None or max(result.rank_memory) < max(over.rank_memory):
                    over = result
        share = (low + high) / 2
    if fitting or over:
        return fitting or over
    assert failure is not None
    raise failure


def _placed(
    inner: Planner, cost_graph: CostGraph, config: PlanConfig, ranks: list[tuple[int]],
    budget: float | None,
) -> Plan:  # fmt: skip
    """The virtual plan (`_virtual_plan`) with its stages on `ranks`, under `config`'s schedule,
    priced and simulated on the real cluster."""
    found = _virtual_plan(inner, cost_graph, config, ranks, budget)
    stages = tuple(dataclasses.replace(s, ranks=ranks[s.index]) for s in found.stages)
    skeleton = found.with_(stages=stages, cluster=config.cluster, schedule=config.rules.name,
                           num_microbatches=config.num_microbatches)  # fmt: skip
    return simulated(price(skeleton, cost_graph)).with_(solve_time_s=found.solve_time_s)


def _virtual_plan(
    inner: Planner, cost_graph: CostGraph, config: PlanConfig, ranks: list[tuple[int]],
    budget: float | None,
) -> Plan:  # fmt: skip
    """The solver's 1F1B plan (`inner`'s) of one stage per rank `ranks` gives each stage, on a
    cluster of as many devices on the slowest link, `budget` bytes each; where the solver
    leaves devices unused (a heavy node bounds every cut), its stages split until each has
    one (`stage_split`)."""
    cluster = config.cluster
    slowest = cluster.levels[-1]
    virtual = Cluster(
        [(len(ranks), slowest.bandwidth, slowest.latency)],
        memory=budget,
        speed=None if cluster.speed is None else [cluster.speed[r] for (r,) in ranks],
        runtime=cluster.runtime,
    )
    one_each = config.replace(cluster=virtual, schedule="1f1b", replica_counts=(1,), chunks=1,
                              recompute=False)  # fmt: skip
    found = inner(cost_graph, one_each)
    if found.num_stages < len(ranks):
        found = split_to(found, len(ranks), cost_graph)
    if found.num_stages != len(ranks):
        chunks = len(ranks) // cluster.num_devices
        raise PartitionError(
            f"solver {config.solver!r} cut the graph into {found.num_stages} stages, but "
            f"chunks={chunks} on {cluster.num_devices} ranks needs {len(ranks)} (the graph has "
            f"too few nodes to cut so many); use fewer chunks"
        )
    return found
