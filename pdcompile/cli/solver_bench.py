"""`pdcompile bench-solvers`: every solver on every instance, scored by `evaluate`.

Each requested solver plans each instance (`bench_instances`) on each cluster; `evaluate`
re-scores every plan (the common yardstick), and each result records the predicted time, its
ratio to the best plan of that instance, the lower bound, the gap and the solve time
(`bench_report` prints and saves them). With a time limit, solvers run in a worker process that
is killed when a solver overruns; a solver that raises or overruns is reported, never ends the
run.

Example:
    >>> from pdcompile.cli.bench_instances import load_instance
    >>> results = run_bench(load_instance("chain:40"), [Cluster.parse("4")], ["dynprog", "uniform"])
    >>> [(r.solver, r.status, round(r.ratio_to_best, 3)) for r in results]
    [('dynprog', 'ok', 1.0), ('uniform', 'ok', 1.049)]
"""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

from pdcompile.cli.bench_instances import Instance
from pdcompile.core.cluster import Cluster
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError, ScheduleError, SpecError
from pdcompile.passes.planning.evaluation import evaluate, lower_bound
from pdcompile.passes.planning.planner import chunk_layout, plan
from pdcompile.passes.planning.plans import Plan
from pdcompile.passes.planning.schedule_choice import AUTO, check_auto_chunks
from pdcompile.passes.planning.solver_kit import SOLVERS, solvers

__all__ = ["BenchResult", "BenchSettings", "load_plugin", "run_bench"]

_STARTUP_S = 120.0  # a worker process importing the solvers and plugins; not charged to solvers


# -- plugins ---------------------------------------------------------------------------------


def load_plugin(spec: str) -> ModuleType:
    """Import a module of solvers (`@pdcompile.register_solver`): a dotted name or a .py path.

    This runs the module's code, like any import.

    Raises:
        SpecError: the module is missing or raised while importing (named with the exception).
    """
    from pdcompile.capture.model_spec import import_user_module  # imports torch.nn

    return import_user_module(spec, f"plugin {spec!r}")


def _known_schedule(name: str) -> None:
    from pdcompile.scheduling import get_schedule

    if name == AUTO:
        return
    try:
        get_schedule(name)
    except ScheduleError as exc:
        raise PartitionError(str(exc)) from None


def _check_chunks(chunks: int | None, kinds: Sequence[str], clusters: Sequence[Cluster]) -> None:
    """Refuse a chunk count every solver would fail alike on, before any solver runs: beside
    "auto" (which chooses its own), or one a schedule does not place on a cluster's ranks
    (`planning.chunk_layout`, `plan()`'s own check)."""
    from pdcompile.scheduling import get_schedule

    if chunks is None:
        return
    for kind in kinds:
        if kind == AUTO:
            check_auto_chunks(chunks)
            continue
        for p in sorted({c.num_devices for c in clusters}):
            chunk_layout(get_schedule(kind), p, chunks)


# -- running ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchResult:
    """One solver on one instance and cluster.

    `status` is "ok", "failed" or "timeout"; the plan's numbers are None unless "ok". `note`: why
    it failed, or the fallback it reported. `ratio_to_best` divides by the best plan of the
    instance, cluster and schedule that fits memory; `lower_bound` is evaluate's (total compute
    over all devices). `step_time`: the simulated seconds per `train_step` call (the yardstick
    across schedules); `step_ratio` divides it by the best (solver, schedule) pair's on the
    instance and cluster that fits memory."""

    instance: str
    cluster: str
    schedule: str
    solver: str
    status: str
    lower_bound: float
    predicted_time: float | None = None
    ratio_to_best: float | None = None
    gap: float | None = None
    solve_time_s: float | None = None
    num_stages: int | None = None
    num_devices_used: int | None = None
    fits_memory: bool | None = None
    note: str = ""
    step_time: float | None = None
    step_ratio: float | None = None


def _serve(conn: Connection, plugins: Sequence[str]) -> None:
    """Worker process: load the plugins, then plan each job sent until None arrives."""
    try:
        for spec in plugins:
            load_plugin(spec)
        solvers()
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    try:
        while (job := conn.recv()) is not None:
            conn.send(_solve(*job))
    except EOFError:  # the parent went away
        return


def _solve(
    cost_graph: CostGraph,
    cluster: Cluster,
    solver: str,
    schedule: str,
    num_microbatches: int | None,
    chunks: int | None,
) -> tuple[str, Plan | str]:
    # Any exception, deliberate or a bug in a (user's) solver, is a result, not the end of a run.
    try:
        return "ok", plan(cost_graph, cluster, solver=solver, schedule=schedule,
                          num_microbatches=num_microbatches, chunks=chunks)  # fmt: skip
    except Exception as e:
        return "failed", f"{type(e).__name__}: {e}"


class _SolverProcess:
    """Runs jobs in a spawned worker; a job past the time limit kills it (the next job starts a
    fresh one). Spawned, not forked: safe beside CUDA and threads, the same on every OS."""

    def __init__(self, plugins: Sequence[str]) -> None:
        self._plugins = tuple(plugins)
        self._process: Any = None
        self._conn: Connection | None = None

    def _start(self) -> Connection:
        context = multiprocessing.get_context("spawn")
        conn, child = context.Pipe()
        # Not a daemon, so a solver may start processes of its own; `close` ends it.
        self._process = context.Process(target=_serve, args=(child, self._plugins))
        self._process.start()
        child.close()
        self._conn = conn
        if not conn.poll(_STARTUP_S):
            self.close()
            raise PartitionError(f"the solver worker process did not start in {_STARTUP_S:g} s")
        try:
            status, message = conn.recv()
        except EOFError:
            self._process.join(5)
            code = self._process.exitcode
            self.close()
            raise PartitionError(
                f"the solver worker process exited while starting (exit code {code}); a script "
                "that runs solvers with a time limit must guard its code with "
                "`if __name__ == '__main__':` (the worker is spawned and imports it)"
            ) from None
        if status != "ready":
            self.close()
            raise SpecError(f"the solver worker process could not load the plugins: {message}")
        return conn

    def solve(self, job: tuple[Any, ...], time_limit_s: float) -> tuple[str, Plan | str]:
        conn = self._conn or self._start()
        conn.send(job)
        if not conn.poll(time_limit_s):
            self.close()
            return "timeout", f"no plan within the time limit of {time_limit_s:g} s"
        try:
            return conn.recv()
        except EOFError:
            self._process.join(5)
            code = self._process.exitcode
            self.close()
            return "failed", f"the solver's worker process died (exit code {code})"

    def close(self) -> None:
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()
            if self._process.pid is not None:
                self._process.join()
            self._process = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _result(
    base: dict[str, Any], status: str, outcome: Plan | str, cost_graph: CostGraph
) -> BenchResult:
    if status != "ok":
        return BenchResult(**base, status=status, note=str(outcome))
    assert isinstance(outcome, Plan)
    try:
        scored = evaluate(outcome, cost_graph)
    except PartitionError as e:
        return BenchResult(**base, status="failed", note=f"its plan does not evaluate: {e}")
    fallback = outcome.options.get("fallback")
    fallback = f"fell back to {fallback}: {outcome.options.get('reason', '')}" if fallback else ""
    return BenchResult(
        **base, status="ok", predicted_time=scored.predicted_time, gap=scored.gap,
        solve_time_s=outcome.solve_time_s, num_stages=scored.num_stages,
        num_devices_used=scored.num_devices_used, fits_memory=scored.fits_memory, note=fallback,
        step_time=scored.step_time,
    )  # fmt: skip


def _with_ratios(results: list[BenchResult]) -> list[BenchResult]:
    best: dict[tuple[str, ...], float] = {}
    steps: dict[tuple[str, ...], float] = {}
    for r in results:
        if r.status == "ok" and r.fits_memory and r.predicted_time is not None:
            key = (r.instance, r.cluster, r.schedule)
            best[key] = min(best.get(key, math.inf), r.predicted_time)
            if r.step_time:
                steps[key[:2]] = min(steps.get(key[:2], math.inf), r.step_time)
    out = []
    for r in results:
        b = best.get((r.instance, r.cluster, r.schedule))
        ratio = r.predicted_time / b if b and r.predicted_time is not None else None
        t = steps.get((r.instance, r.cluster))
        step_ratio = r.step_time / t if t and r.step_time else None
        out.append(BenchResult(**{**asdict(r), "ratio_to_best": ratio, "step_ratio": step_ratio}))
    return out


@dataclass(frozen=True)
class BenchSettings:
    """How `run_bench` plans: the options it passes to `plan` and how solvers run.

    Attributes:
        schedule, num_microbatches, chunks: passed to `plan` (chunks: stages per rank, None
            for each schedule's default).
        schedules: several schedules (instead of `schedule`): every (solver, schedule) pair
            plans the same instances; compare pairs by `step_time` and `step_ratio`.
        time_limit_s: wall-clock seconds per solver run; solvers then run in a worker process
            that loads the built-in solvers and `plugins` (solvers registered in this process
            otherwise are unknown there). None: run here, without a limit.
        plugins: modules to load first (`load_plugin`).
    """

    schedule: str = "1f1b"
    schedules: Sequence[str] | None = None
    num_microbatches: int | None = None
    chunks: int | None = None
    time_limit_s: float | None = None
    plugins: Sequence[str] = ()

    @property
    def kinds(self) -> list[str]:
        """The schedules to plan with: `schedules`, else `schedule` alone."""
        return list(self.schedules or [self.schedule])


def run_bench(
    instances: Sequence[Instance],
    clusters: Sequence[Cluster],
    solver_names: Sequence[str] | None = None,
    settings: BenchSettings | None = None,
) -> list[BenchResult]:
    """Plan every instance on every cluster with every solver and score the plans.

    Args:
        instances: from `load_instance`.
        clusters: each instance is planned on each.
        solver_names: names from `solvers()` (default: all, after loading the plugins).
        settings: the schedule(s), microbatches, chunks, time limit and plugins (default:
            `BenchSettings()`, 1F1B in this process without a limit).

    Returns:
        One result per instance, cluster, solver and schedule, in that order.

    Raises:
        PartitionError: an unknown solver name, a bad schedule or time limit, or a bad chunk
            count (not an integer >= 1, beside "auto", or one a schedule given does not run on
            a cluster's ranks).
        SpecError: a plugin cannot be loaded.
    """
    settings = settings or BenchSettings()
    for spec in settings.plugins:
        load_plugin(spec)
    names = _solver_names(solver_names)
    _check_settings(settings, clusters)
    time_limit_s = settings.time_limit_s
    worker = _SolverProcess(settings.plugins) if time_limit_s is not None else None
    results = []
    try:
        for instance in instances:
            for cluster in clusters:
                bound = lower_bound(instance.cost_graph, cluster)
                for name in names:
                    for kind in settings.kinds:
                        job = (instance.cost_graph, cluster, name, kind,
                               settings.num_microbatches, settings.chunks)  # fmt: skip
                        status, outcome = (
                            worker.solve(job, time_limit_s)
                            if worker and time_limit_s
                            else _solve(*job)
                        )
                        base = dict(instance=instance.name, cluster=str(cluster), schedule=kind,
                                    solver=name, lower_bound=bound)  # fmt: skip
                        results.append(_result(base, status, outcome, instance.cost_graph))
    finally:
        if worker:
            worker.close()
    return _with_ratios(results)


def _solver_names(solver_names: Sequence[str] | None) -> list[str]:
    """The registered names of the solvers asked for (all by default); an old name ("dp") runs
    and reads as the solver's name ("dynprog").

    Raises:
        PartitionError: a name no solver has, listing the registered ones.
    """
    registered = solvers()
    names = [SOLVERS.canonical(n) for n in solver_names or registered]
    unknown = [n for n in names if n not in registered]
    if unknown:
        raise PartitionError(
            f"unknown solver(s) {', '.join(map(repr, unknown))}; registered: "
            f"{', '.join(registered)} (--plugin MODULE loads more)"
        )
    return names


def _check_settings(settings: BenchSettings, clusters: Sequence[Cluster]) -> None:
    """Refuse, before any solver runs, a time limit that is not positive, an unknown schedule
    or a chunk count every solver would fail alike on.

    Raises:
        PartitionError: naming the bad setting.
    """
    time_limit_s = settings.time_limit_s
    if time_limit_s is not None and not time_limit_s > 0:
        raise PartitionError(
            f"the time limit must be a positive number of seconds, got {time_limit_s!r}"
        )
    for kind in settings.kinds:
        _known_schedule(kind)
    _check_chunks(settings.chunks, settings.kinds, clusters)
