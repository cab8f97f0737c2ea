"""`pdcompile.plan`, the solver registry (`register_solver`, `solvers`). Torch-free.

A solver is a pure function `fn(cost_graph, cluster, options: dict) -> Plan`. `options` holds the
caller's solver options plus `schedule` and `num_microbatches`, already resolved. Solvers price
stages with the cost model (`pdcompile.cost_model`) and build their plan with `make_plan`, which
places stages on consecutive ranks and prices them with the cost model (`evaluation.price`), so
every solver is compared on the same yardstick; `plan()` simulates the plan it returns.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from pdcompile.cluster import Cluster
from pdcompile.cost_graph import CostGraph
from pdcompile.errors import PartitionError, PdcompileError, PlanWarning, ScheduleError
from pdcompile.evaluation import price, simulated
from pdcompile.plans import RENAMED_SOLVERS, Plan, Stage, consecutive_ranks
from pdcompile.progress import phase
from pdcompile.registry import Registry
from pdcompile.runtime.validate import check_num_microbatches
from pdcompile.schedules import PipelineSchedule, get_schedule
from pdcompile.schedules.base import MAX_MICROBATCHES
from pdcompile.search.microbatch_count import plan_microbatches
from pdcompile.search.recompute_choice import check_recompute, limited, plan_recompute
from pdcompile.search.schedule_choice import AUTO, plan_auto

Solver = Callable[[CostGraph, Cluster, dict[str, Any]], Plan]
# options `plan()` adds for every solver: the schedule, the microbatches searched with, the
# replica counts allowed (absent: all; the caller's `replica_counts` or microbatch count may rule
# some out), and whether plan() chooses the count (`settled_microbatches` may then round it up)
SEARCH = ("schedule", "num_microbatches", "replica_counts", "even_microbatches")
CHUNK_TRIES = 4  # cuts of a chunked plan under a memory limit, bisecting the stage budget

SOLVERS: Registry[Solver] = Registry(
    "solver",
    (
        "pdcompile.passes.solvers.baselines",
        "pdcompile.passes.solvers.dp",
        "pdcompile.passes.solvers.pipedream",
        "pdcompile.passes.solvers.ideal",
        "pdcompile.passes.solvers.cpsat",
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
    cluster = Cluster.coerce(cluster)
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
    rules = get_schedule(options["schedule"])
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
    return price(skeleton, cost_graph)


def settled_microbatches(
    rules: PipelineSchedule, replicas: Sequence[int], at_least: int, *, even: bool = False
) -> int:
    """The microbatch count a plan with stages of `replicas` runs: the first from `at_least` on
    that the schedule accepts. With `even` (`plan()` chooses the count), the first of those
    that every replica count divides, if it is less than one round of the largest count
    further: then every replica of a stage runs as many microbatches (replica k mod r runs
    microbatch k, so 8 over 3 replicas split 3/3/2 and the third idles; 9 split 3/3/3). Past
    that the split stays uneven, and `plan()` warns.

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


def _planning(cost_graph: CostGraph, cluster: Cluster | str | int) -> str:
    """What progress says while `plan` runs (the searches' own `plan()` calls add nothing); a
    cluster that is none is plan()'s to refuse, not this line's."""
    try:
        on = f" on {Cluster.coerce(cluster).num_devices} devices"
    except PdcompileError:
        on = ""
    return f"planning {cost_graph.graph.number_of_nodes()} nodes{on}"


def plan(
    cost_graph: CostGraph,
    cluster: Cluster | str | int,
    *,
    solver: str = "dynprog",
    schedule: str | PipelineSchedule = "1f1b",
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    replica_counts: Sequence[int] | None = None,
    chunks: int | None = None,
    allow_async: bool = False,
    global_batch_size: int | None = None,
    memory: float | str | None = None,
    recompute: bool | None = None,
    **options: Any,
) -> Plan:
    """Cut `cost_graph` into pipeline stages with replica counts for `cluster`.

    Args:
        cost_graph: costs per node (from `analyze`, `CostGraph.load` or `from_pipedream`).
        cluster: the devices: a `Cluster`, its text (e.g. "8@300GB/s,2@25Gbit/s") or a number
            of devices (`Cluster.coerce`).
        solver: a name from `solvers()` ("dp", the old name of "dynprog", still works).
        schedule: a name from `pdcompile.schedules()` ("1f1b", "gpipe", "pipedream", "2bw", ...),
            or "auto": every synchronous schedule (and chunks per rank it takes) planned as
            here, the fastest `step_time` that fits memory returned, with the comparison in
            `options["auto"]` (`pdcompile.search.schedule_choice`).
        num_microbatches: microbatches per step, at most `MAX_MICROBATCHES` (65536; default:
            twice the number of devices, within that cap, rounded up to the next count the
            schedule accepts for the plan's replicas, and to one that every replica count
            divides if that is less than one round of the largest count further:
            `settled_microbatches`). `compile` runs what is chosen here.
        microbatch_size: rows per microbatch (an integer >= 1); the costs are scaled linearly
            from the graph's batch size.
        replica_counts: the replica counts a stage may have (default: any); e.g. the divisors
            of `num_microbatches`, so that every replica runs as many microbatches. Solvers
            `dynprog`, `ideal` and `cpsat` search within them; a plan from another solver that
            breaks them is refused.
        chunks: stages per rank, one replica each (default: the schedule's `default_chunks`,
            2 for `interleaved-1f1b` and `zb-v`, else 1), placed by the schedule
            (`PipelineSchedule.chunk_rank`: stage i on rank i mod p; `zb-v` in a V).
        allow_async: with schedule="auto", the asynchronous schedules (`pipedream`, `2bw`) are
            candidates too (they change the optimisation's semantics).
        global_batch_size: rows per `train_step`. Without `num_microbatches` (or
            `microbatch_size`), every count M dividing it that the schedule accepts is planned
            at G / M rows per microbatch, each with its own partition, and the fastest fitting
            plan is returned, the counts tried in `options["microbatches"]`
            (`pdcompile.search.microbatch_count`); with "auto", for every candidate schedule.
        memory: bytes per device (a number or a size such as "16GB"), overriding
            `cluster.memory`; "auto": this host's available RAM divided by the devices of the
            cluster's innermost level, less 10% (`search.recompute_choice.host_memory`). A bad
            value raises `PartitionError`, and so does a limit no plan fits (naming the least
            memory a plan tried needs and the stage setting it).
        recompute: activation recomputation (`Stage.recompute`, docs/memory.md): None, the
            planner recomputes the stages that need it to fit the memory limit where that is
            the fastest plan (with "auto", for every schedule); True, every stage; False, none.
            What it costs is in `options["recomputation"]`.
        options: the solver's own options.

    Returns:
        The Plan, with `solve_time_s` set.

    Warns:
        PlanWarning: a stage's replicas run different numbers of microbatches per step (the
            microbatch count is not a multiple of its replica count): the message gives the
            split, what the short replicas idle and the way out (`Plan.uneven_splits`; the
            same text closes `str(plan)`).

    Raises:
        PartitionError: unknown solver or schedule, `cluster` is no cluster, bad
            `replica_counts`, a count out of range (`check_num_microbatches`), a plan whose
            simulation would exceed `runtime.simulator.MAX_ACTIONS` or whose figures no plan
            file holds, or no plan exists (the message says why).
    """
    with phase(_planning(cost_graph, cluster)):
        if num_microbatches is not None:
            num_microbatches = check_num_microbatches(num_microbatches)
        if microbatch_size is not None:
            microbatch_size = check_num_microbatches(microbatch_size, "microbatch_size", cap=None)
        check_recompute(recompute)
        if memory is not None:
            cluster = limited(Cluster.coerce(cluster), memory)
        if isinstance(schedule, str) and schedule == AUTO:
            return plan_auto(
                plan, cost_graph, cluster, allow_async=allow_async, solver=solver,
                num_microbatches=num_microbatches, microbatch_size=microbatch_size,
                replica_counts=replica_counts, chunks=chunks, global_batch_size=global_batch_size,
                recompute=recompute, **options,
            )  # fmt: skip
        if global_batch_size is not None:
            return plan_microbatches(
                plan, cost_graph, cluster, global_batch_size=global_batch_size,
                num_microbatches=num_microbatches, microbatch_size=microbatch_size, solver=solver,
                schedule=schedule, replica_counts=replica_counts, chunks=chunks,
                recompute=recompute, **options,
            )  # fmt: skip
        solve = SOLVERS.get(solver)
        cluster = Cluster.coerce(cluster)
        if recompute is True or (recompute is None and cluster.memory is not None):
            with warnings.catch_warnings():  # the plans tried; the one returned warns below
                warnings.simplefilter("ignore", PlanWarning)
                result = plan_recompute(
                    plan, cost_graph, cluster, recompute=recompute, solver=solver,
                    schedule=schedule, num_microbatches=num_microbatches,
                    microbatch_size=microbatch_size, replica_counts=replica_counts, chunks=chunks,
                    **options,
                )  # fmt: skip
            for split in result.uneven_splits:
                warnings.warn(PlanWarning(result.uneven_note(split)), stacklevel=2)
            return result
        try:
            rules = get_schedule(schedule)
        except ScheduleError as exc:
            raise PartitionError(str(exc)) from None
        if cost_graph.graph.number_of_nodes() == 0:
            raise PartitionError("the cost graph has no nodes; nothing to plan")
        if microbatch_size is not None and microbatch_size != cost_graph.batch_size:
            cost_graph = cost_graph.scaled(microbatch_size)
        chunks = rules.default_chunks if chunks is None else chunks
        if chunks != 1:
            chunked = _plan_chunks(cost_graph, cluster, solver, rules, chunks, num_microbatches,
                                   options)  # fmt: skip
            chunked.to_dict()  # figures no plan file holds raise here, not when it is saved or sent
            return chunked
        # solvers search with twice the devices (within the cap); the count the plan runs is
        # settled after. A count the caller gave limits the replicas to those the schedule accepts
        searched = num_microbatches or min(2 * cluster.num_devices, MAX_MICROBATCHES)
        options = {**options, "schedule": rules.name, "num_microbatches": searched,
                   "even_microbatches": num_microbatches is None}  # fmt: skip
        counts = tuple(range(1, cluster.num_devices + 1))
        allowed = counts if replica_counts is None else _replica_counts(replica_counts, counts)
        if num_microbatches is not None:
            allowed = tuple(r for r in allowed if rules.accepts([r], searched))
            if not allowed:
                raise PartitionError(
                    f"{rules.name} accepts none of replica_counts={tuple(replica_counts or ())} "
                    f"with {num_microbatches} microbatches; add 1 or counts dividing "
                    f"{num_microbatches}"
                )
        if allowed != counts:
            options["replica_counts"] = allowed
        start = time.perf_counter()
        result = solve(cost_graph, cluster, options)
        seconds = time.perf_counter() - start
        _check_tied_replicas(result, solver, rules)
        if replica_counts is not None and any(s.replicas not in allowed for s in result.stages):
            raise PartitionError(
                f"solver {solver!r} gave stages {[s.replicas for s in result.stages]} replicas, "
                f"outside replica_counts={tuple(replica_counts)}; it does not search within them: "
                "use solver 'dynprog', 'ideal' or 'cpsat'"
            )
        if num_microbatches is not None and result.num_microbatches != num_microbatches:
            try:  # the schedule's own reason
                rules.check([s.replicas for s in result.stages], num_microbatches)
            except ScheduleError as exc:
                raise PartitionError(f"solver {solver!r} found {result.num_stages} stages, but "
                                     f"{exc}") from None  # fmt: skip
        result = simulated(result).with_(solve_time_s=seconds)
        result.to_dict()  # figures no plan file holds raise here, not when it is saved or sent
        for split in result.uneven_splits:
            warnings.warn(PlanWarning(result.uneven_note(split)), stacklevel=2)
        return result


def _replica_counts(given: Any, counts: tuple[int, ...]) -> tuple[int, ...]:
    """The caller's `replica_counts`, checked: integers >= 1 (those above the devices drop)."""
    values = tuple(given) if isinstance(given, (list, tuple, range, set, frozenset)) else None
    if not values or not all(
        isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in values
    ):
        raise PartitionError(
            f"replica_counts must be a non-empty sequence of integers >= 1 (e.g. (1, 2, 4) for "
            f"8 microbatches), got {given!r}"
        )
    allowed = tuple(r for r in counts if r in set(values))
    if not allowed:
        raise PartitionError(
            f"replica_counts={tuple(values)}: no stage of a cluster of {len(counts)} devices "
            "can have that many replicas; add smaller counts (1 always fits)"
        )
    return allowed


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


def _plan_chunks(
    cost_graph: CostGraph, cluster: Cluster, solver: str, rules: PipelineSchedule, chunks: int,
    num_microbatches: int | None, options: dict[str, Any],
) -> Plan:  # fmt: skip
    """`chunks` stages per rank, one replica each: the solver cuts the graph into p x chunks
    stages as for as many devices, each with 1/chunks of a device's memory, all on the
    cluster's slowest link (a rank's stages are not neighbours); the schedule places them
    (`chunk_rank`), and the plan is priced and simulated on the real cluster at the first
    microbatch count from 2p on (or the one given) its layout accepts. Under a memory limit the
    solver's budget per stage (its 1F1B counts are not the schedule's) is bisected as a share of
    a device, from 1/chunks, over `CHUNK_TRIES` cuts: a plan whose ranks fit in the simulation
    raises it, one that overshoots (or no plan at all) lowers it; the fastest fitting plan is
    returned, else the one overshooting least."""
    ranks, m = chunk_layout(rules, cluster.num_devices, chunks, num_microbatches)
    if cluster.memory is None:
        return _placed(cost_graph, cluster, solver, rules, ranks, None, m, options)
    # the solver's stage budget, as a share of a device: the largest whose plan fits the ranks
    low, high, share = 0.0, 2.0, 1 / chunks
    fitting: Plan | None = None
    over: Plan | None = None
    failure: PartitionError | None = None
    for _ in range(CHUNK_TRIES):
        try:
            result = _placed(cost_graph, cluster, solver, rules, ranks, share * cluster.memory,
                             m, options)  # fmt: skip
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
    cost_graph: CostGraph, cluster: Cluster, solver: str, rules: PipelineSchedule,
    ranks: list[tuple[int]], budget: float | None, num_microbatches: int,
    options: dict[str, Any],
) -> Plan:  # fmt: skip
    """The virtual plan (`_virtual_plan`) with its stages on `ranks`, under `rules`, priced and
    simulated on the real cluster."""
    found = _virtual_plan(cost_graph, cluster, solver, ranks, budget, num_microbatches, options)
    stages = tuple(dataclasses.replace(s, ranks=ranks[s.index]) for s in found.stages)
    skeleton = found.with_(stages=stages, cluster=cluster, schedule=rules.name,
                           num_microbatches=num_microbatches)  # fmt: skip
    return simulated(price(skeleton, cost_graph)).with_(solve_time_s=found.solve_time_s)


def _virtual_plan(
    cost_graph: CostGraph, cluster: Cluster, solver: str, ranks: list[tuple[int]],
    budget: float | None, num_microbatches: int, options: dict[str, Any],
) -> Plan:  # fmt: skip
    """The solver's 1F1B plan of one stage per rank `ranks` gives each stage, on a cluster of
    as many devices on the slowest link, `budget` bytes each."""
    slowest = cluster.levels[-1]
    virtual = Cluster(
        [(len(ranks), slowest.bandwidth, slowest.latency)],
        memory=budget,
        speed=None if cluster.speed is None else [cluster.speed[r] for (r,) in ranks],
        runtime=cluster.runtime,
    )
    found = plan(cost_graph, virtual, solver=solver, schedule="1f1b",
                 num_microbatches=num_microbatches, replica_counts=[1], chunks=1,
                 recompute=False, **options)  # fmt: skip
    if found.num_stages != len(ranks):
        chunks = len(ranks) // cluster.num_devices
        raise PartitionError(
            f"solver {solver!r} cut the graph into {found.num_stages} stages, but chunks={chunks} "
            f"on {cluster.num_devices} ranks needs {len(ranks)}; use fewer chunks or solver "
            "'uniform'"
        )
    return found
