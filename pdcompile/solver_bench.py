"""`pdcompile bench-solvers`: every solver on every instance, scored by `evaluate`.

Instances are PipeDream profiles, CostGraph JSON files, model specs (traced and costed) and
built-in synthetic chains and DAGs (`chain:N[:SEED]`, `dag:N[:SEED]`). Each requested solver plans
each instance on each cluster; `evaluate` re-scores every plan (the common yardstick), and each
result records the predicted time, its ratio to the best plan of that instance, the lower bound,
the gap and the solve time. With a time limit, solvers run in a worker process that is killed
when a solver overruns; a solver that raises or overruns is reported, never ends the run.
Torch-free except for model specs.

Example:
    >>> results = run_bench(load_instance("chain:40"), [Cluster.parse("4")], ["dp", "uniform"])
    >>> [(r.solver, r.status, round(r.ratio_to_best, 3)) for r in results]
    [('dp', 'ok', 1.0), ('uniform', 'ok', 1.049)]
"""

from __future__ import annotations

import json
import math
import multiprocessing
import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Any

from rich.table import Table
from rich.text import Text

from pdcompile.cluster import Cluster
from pdcompile.cost_graph import CostGraph
from pdcompile.cost_model import evaluate
from pdcompile.errors import PartitionError, SpecError
from pdcompile.planning import plan, solvers
from pdcompile.plans import Plan, Stage
from pdcompile.text import human_seconds

__all__ = [
    "BenchResult",
    "Instance",
    "load_instance",
    "load_instances",
    "load_plugin",
    "results_json",
    "results_table",
    "run_bench",
    "summary_table",
    "synthetic_chain",
    "synthetic_dag",
]

FORMAT = "pdcompile.solver_bench"
VERSION = 1
_SYNTHETIC = re.compile(r"^(chain|dag):(\d+)(?::(\d+))?$")
_STARTUP_S = 120.0  # a worker process importing the solvers and plugins; not charged to solvers


# -- instances -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instance:
    """A named CostGraph to plan; `source` says where it came from."""

    name: str
    cost_graph: CostGraph
    source: str


def _add_layer(g: CostGraph, rng: random.Random, name: str, inputs: Sequence[str]) -> None:
    """A node with random costs (1-5 ms forward, 2-10 ms backward, 1-50 MB parameters)."""
    params = rng.randint(10**6, 5 * 10**7)
    g.add_node(
        name, forward_s=rng.uniform(1e-3, 5e-3), backward_s=rng.uniform(2e-3, 1e-2),
        param_bytes=params, grad_bytes=params, activation_bytes=rng.randint(10**6, 10**7),
        output_bytes=rng.randint(10**6, 10**7),
    )  # fmt: skip
    for u in inputs:
        g.add_edge(u, name, g.graph.nodes[u]["output_bytes"])


def synthetic_chain(layers: int, seed: int = 0) -> CostGraph:
    """A chain of `layers` nodes `l0 -> l1 -> ...` with random costs (deterministic in `seed`)."""
    rng = random.Random(seed)
    g = CostGraph(batch_size=32, meta={"source": f"synthetic chain:{layers}:{seed}"})
    for i in range(layers):
        _add_layer(g, rng, f"l{i}", [f"l{i - 1}"] if i else [])
    return g


def synthetic_dag(num_nodes: int, seed: int = 0) -> CostGraph:
    """A DAG of `num_nodes` nodes with random costs (deterministic in `seed`), built of blocks:
    plain layers, residual blocks (2-4 layers and a merge that also reads the block's input),
    branches (2-3 parallel paths of 1-3 layers joined by a merge), and now and then a long skip
    from one of the last 16 nodes into a plain layer."""
    rng = random.Random(seed)
    g = CostGraph(batch_size=32, meta={"source": f"synthetic dag:{num_nodes}:{seed}"})
    names: list[str] = []

    def layer(inputs: Sequence[str]) -> str:
        name = f"n{len(names)}"
        _add_layer(g, rng, name, list(dict.fromkeys(inputs)))
        names.append(name)
        return name

    last = layer([]) if num_nodes else ""
    while len(names) < num_nodes:
        left, kind = num_nodes - len(names), rng.random()
        if kind < 0.3 and left >= 3:
            x = last
            for _ in range(rng.randint(2, min(4, left - 1))):
                x = layer([x])
            last = layer([x, last])
        elif kind < 0.6 and left >= 3:
            ends, budget = [], left - 1
            for _ in range(rng.randint(2, 3)):
                length = min(rng.randint(1, 3), budget)
                if not length:
                    break
                x = last
                for _ in range(length):
                    x = layer([x])
                budget -= length
                ends.append(x)
            last = layer(ends)
        else:
            skip = [rng.choice(names[-16:])] if len(names) > 2 and rng.random() < 0.2 else []
            last = layer([last, *skip])
    return g


def _pipedream_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if (path / "graph.txt").is_file():
        return [path / "graph.txt"]
    return sorted(path.glob("*/graph.txt"))


def _model_costs(spec_text: str, analytic: bool) -> CostGraph:
    from pdcompile.analysis import analyze
    from pdcompile.model_spec import load_model_spec
    from pdcompile.tracing import trace

    spec = load_model_spec(spec_text)
    gm = trace(spec.model, spec.example_inputs, example_kwargs=spec.example_kwargs)
    return analyze(gm, spec.example_inputs, example_kwargs=spec.example_kwargs,
                   profile=not analytic, progress=False)  # fmt: skip


def load_instance(text: str, *, analytic: bool = True) -> list[Instance]:
    """The instances an INPUT names.

    Args:
        text: `chain:N[:SEED]` or `dag:N[:SEED]` (seed 0 by default); a PipeDream `graph.txt`,
            a folder holding one, or a folder of such folders (one instance each); a CostGraph
            `.json`; or a model spec `package.module:factory` / `file.py:factory`.
        analytic: model specs are priced on the device model instead of profiled.

    Raises:
        SpecError: the input is none of these, a named file or folder does not exist, or a
            graph has no nodes.
        CostError: a cost file is malformed.
    """
    instances = _read_instance(text, analytic)
    for instance in instances:
        if not instance.cost_graph.nodes:
            raise SpecError(f"input {text!r}: {instance.source} has no nodes; nothing to plan")
    return instances


def _read_instance(text: str, analytic: bool) -> list[Instance]:
    synthetic = _SYNTHETIC.match(text)
    if synthetic:
        kind, size, seed = synthetic.group(1), int(synthetic.group(2)), int(synthetic.group(3) or 0)
        if size < 1:
            raise SpecError(f"synthetic instance {text!r}: give at least one node, e.g. {kind}:100")
        make = synthetic_chain if kind == "chain" else synthetic_dag
        return [Instance(text, make(size, seed), "synthetic")]
    path = Path(text)
    if path.suffix == ".json" and path.is_file():
        return [Instance(path.stem, CostGraph.load(path), str(path))]
    if path.exists():
        files = _pipedream_files(path)
        if not files:
            raise SpecError(f"input {text!r}: no graph.txt in this folder or its subfolders")
        return [Instance(f.parent.name, CostGraph.from_pipedream(f), str(f)) for f in files]
    if path.suffix in (".json", ".txt") or ":" not in text:
        raise SpecError(
            f"input {text!r}: no such file or folder; give a PipeDream profile (graph.txt or its "
            "folder), a CostGraph .json, a model spec package.module:factory, or chain:N / dag:N"
        )
    return [Instance(text, _model_costs(text, analytic), text)]


def load_instances(texts: Sequence[str], *, analytic: bool = True) -> list[Instance]:
    """`load_instance` over every INPUT; a repeated name gets a suffix (`vgg16 (2)`)."""
    instances, seen = [], dict[str, int]()
    for text in texts:
        for instance in load_instance(text, analytic=analytic):
            seen[instance.name] = seen.get(instance.name, 0) + 1
            if seen[instance.name] > 1:
                instance = Instance(f"{instance.name} ({seen[instance.name]})",
                                    instance.cost_graph, instance.source)  # fmt: skip
            instances.append(instance)
    return instances


# -- plugins ---------------------------------------------------------------------------------


def load_plugin(spec: str) -> ModuleType:
    """Import a module of solvers (`@pdcompile.register_solver`): a dotted name or a .py path.

    This runs the module's code, like any import.

    Raises:
        SpecError: the module is missing or raised while importing (named with the exception).
    """
    from pdcompile.model_spec import import_user_module  # imports torch.nn

    return import_user_module(spec, f"plugin {spec!r}")


# -- running ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchResult:
    """One solver on one instance and cluster.

    `status` is "ok", "failed" or "timeout"; the plan's numbers are None unless "ok". `note`: why
    it failed, or the fallback it reported. `ratio_to_best` divides by the best plan of the
    instance and cluster that fits memory; `lower_bound` is evaluate's (total compute over all
    devices)."""

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
) -> tuple[str, Plan | str]:
    # Any exception, deliberate or a bug in a (user's) solver, is a result, not the end of a run.
    try:
        return "ok", plan(cost_graph, cluster, solver=solver, schedule=schedule,
                          num_microbatches=num_microbatches)  # fmt: skip
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


def _lower_bound(cost_graph: CostGraph, cluster: Cluster, schedule: str) -> float:
    """evaluate's bound, from the one-stage plan on every device (the bound is plan-free)."""
    everyone = tuple(range(cluster.num_devices))
    stage = Stage(index=0, nodes=tuple(cost_graph.nodes), replicas=len(everyone), ranks=everyone)
    return evaluate(
        Plan(stages=(stage,), cluster=cluster, schedule=schedule), cost_graph
    ).lower_bound


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
    )  # fmt: skip


def _with_ratios(results: list[BenchResult]) -> list[BenchResult]:
    best: dict[tuple[str, str], float] = {}
    for r in results:
        if r.status == "ok" and r.fits_memory and r.predicted_time is not None:
            key = (r.instance, r.cluster)
            best[key] = min(best.get(key, math.inf), r.predicted_time)
    out = []
    for r in results:
        b = best.get((r.instance, r.cluster))
        ratio = r.predicted_time / b if b and r.predicted_time is not None else None
        out.append(BenchResult(**{**asdict(r), "ratio_to_best": ratio}))
    return out


def run_bench(
    instances: Sequence[Instance],
    clusters: Sequence[Cluster],
    solver_names: Sequence[str] | None = None,
    *,
    schedule: str = "1f1b",
    num_microbatches: int | None = None,
    time_limit_s: float | None = None,
    plugins: Sequence[str] = (),
) -> list[BenchResult]:
    """Plan every instance on every cluster with every solver and score the plans.

    Args:
        instances: from `load_instance`.
        clusters: each instance is planned on each.
        solver_names: names from `solvers()` (default: all, after loading `plugins`).
        schedule, num_microbatches: passed to `plan`.
        time_limit_s: wall-clock seconds per solver run; solvers then run in a worker process
            that loads the built-in solvers and `plugins` (solvers registered in this process
            otherwise are unknown there). None: run here, without a limit.
        plugins: modules to load first (`load_plugin`).

    Returns:
        One result per instance, cluster and solver, in that order.

    Raises:
        PartitionError: an unknown solver name, or a bad schedule or time limit.
        SpecError: a plugin cannot be loaded.
    """
    for spec in plugins:
        load_plugin(spec)
    registered = solvers()
    names = list(solver_names or registered)
    unknown = [n for n in names if n not in registered]
    if unknown:
        raise PartitionError(
            f"unknown solver(s) {', '.join(map(repr, unknown))}; registered: "
            f"{', '.join(registered)} (--plugin MODULE loads more)"
        )
    if time_limit_s is not None and not time_limit_s > 0:
        raise PartitionError(
            f"the time limit must be a positive number of seconds, got {time_limit_s!r}"
        )
    worker = _SolverProcess(plugins) if time_limit_s is not None else None
    results = []
    try:
        for instance in instances:
            for cluster in clusters:
                bound = _lower_bound(instance.cost_graph, cluster, schedule)
                for name in names:
                    job = (instance.cost_graph, cluster, name, schedule, num_microbatches)
                    status, outcome = (
                        worker.solve(job, time_limit_s) if worker and time_limit_s else _solve(*job)
                    )
                    base = dict(instance=instance.name, cluster=str(cluster), schedule=schedule,
                                solver=name, lower_bound=bound)  # fmt: skip
                    results.append(_result(base, status, outcome, instance.cost_graph))
    finally:
        if worker:
            worker.close()
    return _with_ratios(results)


# -- reports ---------------------------------------------------------------------------------


def _sort_key(r: BenchResult) -> tuple[Any, ...]:
    return (r.status != "ok", r.predicted_time if r.predicted_time is not None else 0, r.solver)


def _note(r: BenchResult, width: int = 48) -> str:
    text = r.note.splitlines()[0] if r.note else ""
    return text if len(text) <= width else text[: width - 3] + "..."


def results_table(results: Sequence[BenchResult], title: str | None = None) -> Table:
    """One row per result, grouped by instance and cluster, fastest plan first. With a single
    instance and cluster those columns move into the title."""
    groups: dict[tuple[str, str], list[BenchResult]] = {}
    for r in results:
        groups.setdefault((r.instance, r.cluster), []).append(r)
    single = len(groups) == 1
    schedule = results[0].schedule if results else "1f1b"
    if title is None:
        where = f"{next(iter(groups))[0]} on {next(iter(groups))[1]}, " if single else ""
        title = f"{where}schedule {schedule}, plans scored under evaluate"
    table = Table(title=Text(title))  # Text: names such as dag:100:1 are not markup or emoji
    columns = ([] if single else ["instance", "cluster"]) + [
        "solver", "predicted", "vs best", "lower bound", "gap", "stages", "devices",
        "fits memory", "solve time",
    ]  # fmt: skip
    notes = any(r.note for r in results)
    for column in [*columns, *(["note"] if notes else [])]:
        left = column in ("instance", "cluster", "solver", "note")
        table.add_column(column, justify="left" if left else "right")
    for key, rows in groups.items():
        for i, r in enumerate(sorted(rows, key=_sort_key)):
            where = [] if single else [key[0] if i == 0 else "", key[1] if i == 0 else ""]
            if r.status == "ok":
                assert r.predicted_time is not None and r.gap is not None
                cells = [
                    human_seconds(r.predicted_time),
                    f"{r.ratio_to_best:.3f}" if r.ratio_to_best is not None else "-",
                    human_seconds(r.lower_bound), f"{r.gap:.1%}", str(r.num_stages),
                    str(r.num_devices_used), "yes" if r.fits_memory else "NO",
                    f"{r.solve_time_s:.3f} s",
                ]  # fmt: skip
            else:
                cells = [r.status, "-", human_seconds(r.lower_bound), *["-"] * 5]
            table.add_row(*map(Text, [*where, r.solver, *cells, *([_note(r)] if notes else [])]))
        table.add_section()
    return table


def _summary(results: Sequence[BenchResult]) -> list[dict[str, Any]]:
    by_solver: dict[str, list[BenchResult]] = {}
    for r in results:
        by_solver.setdefault(r.solver, []).append(r)
    rows = []
    for solver, rs in by_solver.items():
        ratios = [r.ratio_to_best for r in rs if r.ratio_to_best is not None]
        rows.append({
            "solver": solver, "runs": len(rs), "ok": sum(r.status == "ok" for r in rs),
            "failed": sum(r.status == "failed" for r in rs),
            "timeout": sum(r.status == "timeout" for r in rs),
            "best": sum(bool(r.fits_memory) and (r.ratio_to_best or math.inf) <= 1 + 1e-9
                        for r in rs),
            "geomean_ratio": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
            "worst_ratio": max(ratios) if ratios else None,
            "solve_time_s": math.fsum(r.solve_time_s or 0.0 for r in rs),
        })  # fmt: skip
    return sorted(rows, key=lambda s: (s["geomean_ratio"] is None, s["geomean_ratio"] or 0))


def summary_table(results: Sequence[BenchResult]) -> Table:
    """Per solver: runs that gave a plan, how often it was the best, the geometric mean and the
    worst of its ratios to the best, and its total solve time."""
    table = Table(title="per solver, over every instance and cluster")
    for column in ("solver", "plans", "best", "geo-mean vs best", "worst vs best", "solve time"):
        table.add_column(column, justify="left" if column == "solver" else "right")
    for s in _summary(results):
        table.add_row(*map(Text, [
            s["solver"], f"{s['ok']}/{s['runs']}", str(s["best"]),
            f"{s['geomean_ratio']:.3f}" if s["geomean_ratio"] is not None else "-",
            f"{s['worst_ratio']:.3f}" if s["worst_ratio"] is not None else "-",
            f"{s['solve_time_s']:.2f} s" if s["ok"] else "-",
        ]))  # fmt: skip
    return table


def results_json(
    results: Sequence[BenchResult], instances: Sequence[Instance] = (), **settings: Any
) -> str:
    """JSON of the results, the per-solver summary, the instances and the run's `settings`."""
    return json.dumps(
        {
            "format": FORMAT,
            "version": VERSION,
            "settings": settings,
            "instances": [
                {
                    "name": i.name,
                    "source": i.source,
                    "nodes": i.cost_graph.graph.number_of_nodes(),
                    "edges": i.cost_graph.graph.number_of_edges(),
                    "batch_size": i.cost_graph.batch_size,
                }
                for i in instances
            ],  # fmt: skip
            "results": [asdict(r) for r in results],
            "summary": _summary(results),
        },
        indent=1,
    )
