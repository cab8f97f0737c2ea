"""The `pdcompile` command. Thin: every flag maps to an API argument.

pdcompile graph INPUT [--format txt|json|dot|svg|png] [--out FILE] [--leaf NAME ...]
pdcompile profile SPEC [--device cpu|cuda] [--analytic] [--device-model NAME] [--coarsen N]
                       [--calibration on|off] [--out costs.json]
pdcompile calibrate [--device cpu|cuda] [--threads N] [--repeats R] [--no-cache] [--json FILE]
                    [--cluster]  (under torchrun: the job's measured cluster)
pdcompile codegen SPEC (--plan plan.json | --cluster SPEC [--solver NAME] [--chunks N]) --out DIR
pdcompile simulate INPUT [--cluster SPEC] [--solver NAME] [--schedule NAME] [--microbatches M]
                         [--chunks N] [--png FILE | --svg FILE] [--trace FILE] [--measured TRACE]
pdcompile bench-solvers INPUT... --cluster SPEC [--solvers a,b] [--schedules a,b] [--chunks N]
    [--plugin MODULE] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from pdcompile.cli.parser import RECOMPUTE, build_parser
from pdcompile.cli.progress import progress
from pdcompile.core.errors import PartitionError, PdcompileError, SpecError
from pdcompile.core.regular_file import read_regular_text


def _leaf_modules(model: Any, names: Sequence[str]) -> list[Any]:
    """`--leaf` values: a submodule's qualified name, else the class name of some submodule."""
    modules = dict(model.named_modules())
    types = {}
    for module in modules.values():
        cls = type(module)
        types.setdefault(cls.__name__, cls)
        types.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)
    return [name if name in modules or name not in types else types[name] for name in names]


def _trace_spec(args: argparse.Namespace) -> tuple[Any, Any]:
    """Load the SPEC and capture it; automatic leaves are reported on standard error."""
    from pdcompile.capture.model_spec import load_model_spec
    from pdcompile.capture.tracing import trace

    spec = load_model_spec(args.spec)
    if args.eval:
        spec.model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = trace(
            spec.model,
            spec.example_inputs,
            example_kwargs=spec.example_kwargs,
            method=args.method,
            leaf_modules=_leaf_modules(spec.model, args.leaf),
        )
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    return spec, gm


def _cost_file(path: str) -> Any:
    """The CostGraph in a `.json` or PipeDream `graph.txt` named on the command line, else None."""
    from pdcompile.core.cost_graph import CostGraph

    if path.endswith(".json"):
        loader = CostGraph.load
    elif path.endswith(".txt"):
        loader = CostGraph.from_pipedream
    else:
        return None
    if not os.path.exists(path):  # the loader names what else it is (a folder, a FIFO)
        raise SpecError(f"no such file {path!r} (expected a CostGraph .json or a PipeDream .txt)")
    return loader(path)


def _print_table(table: Table, out: str | None) -> None:
    if out:
        with open(out, "w") as f:
            Console(file=f, width=200).print(table)
    else:
        Console(width=None if sys.stdout.isatty() else 200).print(table)


def _write(data: str | bytes, out: str | None) -> None:
    if out:
        with open(out, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
    elif isinstance(data, bytes):
        raise PdcompileError("this format writes a binary file: give --out FILE")
    else:
        sys.stdout.write(data)


def _graph(args: argparse.Namespace) -> int:
    from pdcompile.cli.cost_report import cost_dot, cost_table
    from pdcompile.passes.planning.plans import Plan

    if args.plan and args.format in ("txt", "json"):
        raise PdcompileError(
            f"--plan colours a drawing: add --format dot, svg or png (got --format {args.format})"
        )
    plan = Plan.load(args.plan) if args.plan else None
    costs = _cost_file(args.spec)
    if costs is not None:
        name = os.path.basename(os.path.dirname(os.path.abspath(args.spec))) or args.spec
        views = (
            lambda: cost_table(costs, name), costs.to_json, lambda: cost_dot(costs, name, plan)
        )  # fmt: skip
    else:
        from pdcompile.cli.graph_report import to_dot, to_json, to_table

        spec, gm = _trace_spec(args)
        name = type(spec.model).__name__
        views = (
            lambda: to_table(gm, name), lambda: to_json(gm, name), lambda: to_dot(gm, name, plan)
        )  # fmt: skip
    table, as_json, dot = views
    if args.format == "txt":
        _print_table(table(), args.out)
    elif args.format == "json":
        _write(as_json(), args.out)
    elif args.format == "dot":
        _write(dot(), args.out)
    else:
        from pdcompile.cli.graph_report import render_dot

        if not args.out:
            raise PdcompileError(f"--format {args.format} writes a binary file: give --out FILE")
        _write(render_dot(dot(), args.format), args.out)
    return 0


def _profile(args: argparse.Namespace) -> int:
    from pdcompile.cli.cost_report import cost_table, framework_line, noisy_table
    from pdcompile.compiling.analysis import analyze

    spec, gm = _trace_spec(args)
    costs = analyze(
        gm,
        spec.example_inputs,
        example_kwargs=spec.example_kwargs,
        profile=not args.analytic,
        device=args.device,
        optimizer=args.optimizer,
        device_model=args.device_model,
        coarsen=args.coarsen,
        num_threads=args.threads,
        cache=not args.no_cache,
        calibration={"on": True, "off": False}.get(args.calibration),
    )
    _print_table(cost_table(costs, type(spec.model).__name__, top=args.top), None)
    noisy = noisy_table(costs)
    if noisy is not None:
        _print_table(noisy, None)
    line = framework_line(costs)
    if line:
        print(line)
    if args.out:
        costs.save(args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    if args.cluster:
        return _measure_cluster(args)
    from pdcompile.cli.cost_report import calibration_table
    from pdcompile.passes.framework_cost import calibrate

    cost = calibrate(args.device, num_threads=args.threads, repeats=args.repeats,
                     cache=not args.no_cache, refresh=True)  # fmt: skip
    _print_table(calibration_table(cost), None)
    if args.json:
        _write(json.dumps(cost.to_dict(), indent=2) + "\n", args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _costs(args: argparse.Namespace) -> tuple[Any, str]:
    """The CostGraph named by INPUT: a cost file, or a SPEC traced and analysed."""
    costs = _cost_file(args.spec)
    if costs is not None:
        return costs, os.path.basename(os.path.dirname(os.path.abspath(args.spec)))
    from pdcompile.compiling.analysis import analyze

    spec, gm = _trace_spec(args)
    costs = analyze(gm, spec.example_inputs, example_kwargs=spec.example_kwargs,
                    profile=not args.analytic, progress=False)  # fmt: skip
    return costs, type(spec.model).__name__


def _cluster(args: argparse.Namespace) -> Any:
    from pdcompile.core.cluster import Cluster

    return Cluster.parse(args.cluster, memory=args.memory)


def _measure_cluster(args: argparse.Namespace) -> int:
    """`pdcompile calibrate --cluster` on every rank of a torchrun job."""
    import torch

    from pdcompile.runtime.cluster_measure import measure_cluster
    from pdcompile.runtime.distributed import init_process_group

    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", 1)) < 2:
        raise PartitionError(
            "pdcompile calibrate --cluster measures a job's cluster: run it on every host under "
            "torchrun with two or more ranks, e.g. torchrun --nnodes 2 --nproc-per-node 1 ... "
            "$(which pdcompile) calibrate --cluster"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(args.threads)
    device = init_process_group(rank, world_size, timeout_s=300.0)
    if args.device:
        device = torch.device(args.device)
    # max_age_s=0: whatever is cached is measured again (and replaced)
    cluster = measure_cluster(rank, world_size, device, cache=not args.no_cache, max_age_s=0.0)
    if rank == 0:
        print("\n".join(cluster.describe_measurement()))
        if args.json:
            _write(cluster.to_json() + "\n", args.json)
            print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from pdcompile.core.errors import PlanWarning
    from pdcompile.passes.planning.microbatch_count import counts_table
    from pdcompile.passes.planning.planner import plan
    from pdcompile.passes.planning.schedule_choice import auto_table

    costs, _ = _costs(args)
    if args.measured:
        return _replan(args, costs)
    cluster = _cluster(args)
    with warnings.catch_warnings(), progress(_planning(costs, cluster, args.solver)):
        warnings.simplefilter("ignore", PlanWarning)  # the table's notes say the same
        result = plan(costs, cluster, solver=args.solver, schedule=args.schedule,
                      num_microbatches=args.microbatches, chunks=args.chunks,
                      allow_async=args.allow_async, recompute=RECOMPUTE[args.recompute],
                      global_batch_size=args.global_batch_size)  # fmt: skip
    print(result)
    # --schedule auto: how every candidate compared; else --global-batch-size: every count
    comparison = auto_table(result) or counts_table(result)
    if comparison:
        print()
        print(comparison)
    if args.out:
        result.save(args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _planning(costs: Any, cluster: Any, solver: str) -> str:
    """What the progress display says while `costs` are planned."""
    return f"planning {len(costs.graph)} nodes on {cluster.num_devices} devices ({solver})"


def _replan(args: argparse.Namespace, costs: Any) -> int:
    """`plan --measured TRACE`: the plan the trace ran, re-priced on the measured stage times,
    against a new plan of those costs under the same schedule (`replan.decide`)."""
    from pdcompile.core.errors import PlanWarning
    from pdcompile.passes.planning.plans import Plan
    from pdcompile.passes.planning.replan_decision import decide, measured_stage_times
    from pdcompile.passes.planning.timeline import load_trace, trace_meta

    ran = trace_meta(args.measured).get("plan")
    if ran is None:
        raise PdcompileError(
            f"{args.measured} holds no plan: write traces with PipelinedModule.save_trace"
        )
    running = Plan.from_dict(ran).with_(cluster=_cluster(args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        decision = decide(costs, running, measured_stage_times(load_trace(args.measured)),
                          solver=args.solver, threshold=0.0)  # fmt: skip
    print(decision.new)
    print()
    print(decision.describe())
    if args.out:
        decision.new.save(args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _codegen(args: argparse.Namespace) -> int:
    from pdcompile.compiling.analysis import analyze
    from pdcompile.core.cost_graph import CostGraph
    from pdcompile.lowering.stage_codegen import codegen
    from pdcompile.passes.planning.planner import plan
    from pdcompile.passes.planning.plans import Plan

    if args.plan:
        _refuse_with_plan_file(args, "solver", "memory", "schedule", "microbatches", "chunks")
    spec, gm = _trace_spec(args)
    if args.plan:
        made = Plan.load(args.plan)
    else:
        costs = analyze(gm, spec.example_inputs, example_kwargs=spec.example_kwargs,
                        profile=False, progress=False)  # fmt: skip
        made = plan(
            costs,
            _cluster(args),
            solver=args.solver or "dynprog",
            schedule=args.schedule or "1f1b",
            num_microbatches=args.microbatches,
            chunks=args.chunks,
        )
        print(made)
    program = codegen(gm, made, cost_graph=CostGraph.load(args.costs) if args.costs else None)
    program.write_source(args.out)
    print(program)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _refuse_with_plan_file(args: argparse.Namespace, *options: str) -> None:
    """A plan read from a file fixes what these planning options would choose: refuse them."""
    given = [f"--{name}" for name in options if getattr(args, name) is not None]
    if given:
        raise SpecError(
            f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only when pdcompile "
            "plans here (with --cluster and a model); the plan file fixes the plan: drop "
            f"{'it' if len(given) == 1 else 'them'}, or plan again with `pdcompile plan`"
        )


def _is_plan_file(path: str) -> bool:
    """Whether `path` is a Plan JSON (`pdcompile plan --out`), by its format marker."""
    from pdcompile.passes.planning.plans import FORMAT

    if not (path.endswith(".json") and os.path.isfile(path)):
        return False
    try:
        return json.loads(read_regular_text(path)).get("format") == FORMAT
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def _simulate(args: argparse.Namespace) -> int:
    from pdcompile.passes.planning.planner import plan
    from pdcompile.passes.planning.plans import Plan
    from pdcompile.passes.planning.simulator import simulate
    from pdcompile.passes.planning.timeline import load_trace
    from pdcompile.pictures.gantt import plot_timelines

    figure, kind = (args.png, "png") if args.png else (args.svg, "svg")
    if figure and not figure.lower().endswith(f".{kind}"):
        raise PdcompileError(f"--{kind} FILE needs a file name ending in .{kind}, got {figure!r}")
    if args.measured and not figure:
        raise PdcompileError("--measured draws beside the simulation: give --png or --svg FILE")
    measured = load_trace(args.measured) if args.measured else []
    cluster = _cluster(args) if args.cluster else None
    if _is_plan_file(args.spec):
        _refuse_with_plan_file(args, "solver", "chunks", *(() if args.cluster else ("memory",)))
        made = Plan.load(args.spec)
    elif cluster is None:
        raise PdcompileError(f"{args.spec} is not a Plan JSON: give --cluster to plan it")
    else:
        costs, _ = _costs(args)
        with progress(_planning(costs, cluster, args.solver or "dynprog")):
            made = plan(costs, cluster, solver=args.solver or "dynprog",
                        schedule=args.schedule or "1f1b", num_microbatches=args.microbatches,
                        chunks=args.chunks)  # fmt: skip
        print(made)
    sim = simulate(made, schedule=args.schedule, num_microbatches=args.microbatches,
                   cluster=cluster)  # fmt: skip
    _print_table(_simulation_table(sim), None)
    if args.trace:
        sim.to_chrome_trace(args.trace)
        print(f"wrote {args.trace}", file=sys.stderr)
    if figure:
        p = sim.plan
        title = (
            f"simulated: {p.solver or '?'} plan, {p.schedule}, {p.num_microbatches} "
            f"microbatches on {p.cluster}"
        )
        name = os.path.basename(args.measured or "")
        panels = [(f"measured: {name}", measured)] if args.measured else []
        plot_timelines([*panels, (title, sim.timeline)], figure)
        print(f"wrote {figure}", file=sys.stderr)
    return 0


def _simulation_table(sim: Any) -> Table:
    """Time per step, and per rank its stages (several with chunks), bubble fraction and peak
    memory."""
    from pdcompile.core.text import human_bytes, human_seconds

    p = sim.plan
    stages_of_rank: dict[int, list[str]] = {}
    for s in p.stages:
        for rank in s.ranks:
            stages_of_rank.setdefault(rank, []).append(str(s.index))
    several = any(len(stages) > 1 for stages in stages_of_rank.values())
    table = Table(
        title=f"simulated step: {human_seconds(sim.time_per_step)}",
        caption=f"{p.schedule}, {p.num_microbatches} microbatches on {p.cluster}",
    )
    for column in ("rank", "stages" if several else "stage", "bubble", "peak memory"):
        table.add_column(column, justify="right")
    for rank, bubble in enumerate(sim.bubble_fraction):
        table.add_row(str(rank), ", ".join(stages_of_rank.get(rank, ["-"])), f"{bubble:.1%}",
                      human_bytes(sim.peak_memory[rank]))  # fmt: skip
    return table


def _solvers(args: argparse.Namespace) -> int:
    from pdcompile.passes.planning.solver_kit import SOLVERS, solvers

    for name, description in solvers().items():
        print(f"{name:12s} {description}")
    for old, name in SOLVERS.aliases.items():
        print(f"{old:12s} the old name of {name}")
    return 0


def _bench_solvers(args: argparse.Namespace) -> int:
    from pdcompile.cli.bench_instances import load_instances
    from pdcompile.cli.bench_report import pairs_table, results_json, results_table, summary_table
    from pdcompile.cli.solver_bench import BenchSettings, run_bench
    from pdcompile.core.cluster import Cluster

    instances = load_instances(args.inputs, analytic=args.analytic)
    clusters = [Cluster.parse(text, memory=args.memory) for text in args.cluster]
    names = [n.strip() for n in args.solvers.split(",") if n.strip()] if args.solvers else None
    kinds = [n.strip() for n in args.schedules.split(",") if n.strip()] if args.schedules else None
    settings = dict(schedule=args.schedule, num_microbatches=args.microbatches,
                    time_limit_s=args.time_limit or None, plugins=args.plugin)  # fmt: skip
    if kinds:  # the (solver, schedule) pairs axis
        settings["schedules"] = kinds
    if args.chunks is not None:
        settings["chunks"] = args.chunks
    results = run_bench(instances, clusters, names, BenchSettings(**settings))
    _print_table(results_table(results), None)
    if kinds and len(kinds) > 1:
        _print_table(pairs_table(results), None)
    if len(instances) * len(clusters) > 1:
        _print_table(summary_table(results), None)
    if args.json:
        text = results_json(results, instances, clusters=args.cluster, memory=args.memory,
                            **settings)  # fmt: skip
        _write(text, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "graph": _graph, "profile": _profile, "calibrate": _calibrate, "plan": _plan,
    "codegen": _codegen,
    "simulate": _simulate, "solvers": _solvers, "bench-solvers": _bench_solvers,
    "compare": _bench_solvers,
}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pdcompile` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except PdcompileError as e:
        if args.debug:
            raise
        print(f"pdcompile: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, SpecError) else 1


if __name__ == "__main__":
    sys.exit(main())
