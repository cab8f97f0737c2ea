"""The `pdcompile` command's arguments: one subparser per command, every flag an API argument."""

from __future__ import annotations

import argparse

from pdcompile.passes.planning.schedule_choice import AUTO
from pdcompile.scheduling import schedules

FORMATS = ("txt", "json", "dot", "svg", "png")
# = pdcompile.capture.tracing.METHODS, repeated so the CLI starts without importing torch
METHODS = ("auto", "fx", "export")


def _plan_options(
    parser: argparse.ArgumentParser, plan_file: bool = False, auto: bool = False
) -> None:
    """INPUT and the planning options; with `plan_file`, INPUT may also be a Plan JSON, whose
    cluster and schedule are the defaults; with `auto`, --schedule may be "auto"."""
    parser.add_argument(
        "spec", metavar="INPUT",
        help=("plan.json, " if plan_file else "")
        + "package.module:factory, file.py:factory, costs.json or PipeDream graph.txt",
    )  # fmt: skip
    parser.add_argument(
        "--cluster", required=not plan_file,
        help="e.g. 8@300GB/s,16@25Gbit/s or 4" + (" (default: the plan's)" if plan_file else ""),
    )  # fmt: skip
    parser.add_argument("--memory", help="bytes per device, e.g. 80GB")
    parser.add_argument(
        "--schedule",
        choices=list(schedules()) + ([AUTO] if auto else []),
        default=None if plan_file else "1f1b",
        help="auto: plan every synchronous schedule, keep the fastest that fits" if auto else None,
    )
    parser.add_argument("--microbatches", type=int, help="microbatches per step")
    _chunks_option(parser)
    parser.add_argument("--analytic", action="store_true", help="a SPEC is costed analytically")
    _capture_options(parser)


# --recompute's choices: plan()'s `recompute` (None: the planner decides)
RECOMPUTE = {"auto": None, "on": True, "off": False}


def _chunks_option(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    parser.add_argument(
        "--chunks", type=int, metavar="N",
        help=f"{prefix}stages per rank (default: the schedule's, 2 for interleaved-1f1b and "
        "zb-v, else 1)",
    )  # fmt: skip


def _capture_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--leaf", nargs="+", default=[], metavar="NAME",
        help="extra leaf modules: qualified names or class names",
    )  # fmt: skip
    parser.add_argument("--method", choices=METHODS, default="auto", help="capture path")
    parser.add_argument("--eval", action="store_true", help="capture the model in eval mode")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; `args.command` names the one given (`compare` is
    `bench-solvers`)."""
    parser = argparse.ArgumentParser(
        prog="pdcompile", description="Pipeline-parallel training compiler for PyTorch."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True)
    for add_command in (  # in the order `pdcompile --help` lists them
        _add_graph,
        _add_profile,
        _add_calibrate,
        _add_plan,
        _add_codegen,
        _add_simulate,
        _add_solvers,
        _add_bench_solvers,
    ):
        add_command(commands)
    return parser


def _add_graph(commands: argparse._SubParsersAction) -> None:
    """`pdcompile graph`: a model's captured graph, or a CostGraph's nodes with their costs."""
    graph = commands.add_parser(
        "graph",
        help="show a model's captured graph, or a CostGraph",
        description="Show a graph: a model's captured graph (one row per node with output "
        "shapes, bytes and the parameters it owns), or the nodes of a CostGraph JSON or "
        "PipeDream graph.txt with their costs.",
    )
    graph.add_argument(
        "spec", metavar="INPUT",
        help="package.module:factory, path/file.py:factory, costs.json or PipeDream graph.txt",
    )  # fmt: skip
    graph.add_argument("--format", choices=FORMATS, default="txt")
    graph.add_argument("--out", metavar="FILE", help="write here instead of standard output")
    graph.add_argument(
        "--plan", metavar="FILE",
        help="a Plan JSON: dot, svg and png fill nodes with their stage's colour and label the "
        "edges between stages with their bytes",
    )  # fmt: skip
    _capture_options(graph)


def _add_profile(commands: argparse._SubParsersAction) -> None:
    """`pdcompile profile`: label every node with its costs and write the CostGraph."""
    profile = commands.add_parser(
        "profile",
        help="measure (or estimate) what every node costs and write the CostGraph",
        description="Capture a model, label every node with forward/backward time, FLOPs and "
        "memory, print the costliest nodes and the totals, and write the CostGraph.",
    )
    profile.add_argument("spec", metavar="SPEC", help="package.module:factory or file.py:factory")
    profile.add_argument("--device", help="where to profile: cpu, cuda, cuda:1 (default: cpu)")
    profile.add_argument("--analytic", action="store_true", help="roofline estimates, no runs")
    profile.add_argument("--device-model", help="roofline preset: cpu, a100, h100")
    profile.add_argument("--optimizer", choices=("sgd", "momentum", "adam"), default="sgd")
    profile.add_argument("--coarsen", type=int, metavar="N", help="group into at most N layers")
    profile.add_argument("--threads", type=int, default=1, help="CPU threads while profiling")
    profile.add_argument("--top", type=int, default=15, help="rows in the table")
    profile.add_argument("--no-cache", action="store_true", help="profile again, skip the cache")
    profile.add_argument("--out", metavar="FILE", help="write the CostGraph JSON here")
    profile.add_argument(
        "--calibration", choices=("on", "off"),
        help="fold the per-operation framework cost into the times (default: on when "
        "profiling, off with --analytic; on with --analytic folds the cached calibration)",
    )  # fmt: skip
    _capture_options(profile)


def _add_calibrate(commands: argparse._SubParsersAction) -> None:
    """`pdcompile calibrate`: this machine's per-operation framework cost, or the cluster's."""
    calibrate = commands.add_parser(
        "calibrate",
        help="measure the per-operation framework cost of this machine (seconds)",
        description="Measure what a training step pays per ATen operation forward and per "
        "autograd node backward besides the arithmetic (dispatch, autograd bookkeeping, "
        "allocation; on CUDA the kernel launch), at the profiling thread count, and cache it "
        "beside the profile cache; `analyze` folds it into every node's times.",
    )
    calibrate.add_argument("--device", help="cpu, cuda, cuda:1 (default: cpu)")
    calibrate.add_argument("--threads", type=int, default=1, help="CPU threads (the profile's)")
    calibrate.add_argument("--repeats", type=int, default=30, help="timed runs of every chain")
    calibrate.add_argument("--no-cache", action="store_true", help="measure without saving")
    calibrate.add_argument("--json", metavar="FILE", help="write the calibration as JSON here")
    calibrate.add_argument(
        "--cluster", action="store_true",
        help="measure the job's cluster instead (under torchrun, 2 or more ranks): hosts, links "
        "per level, rank speeds, memory, as compile(cluster='auto') does; rank 0 prints it and "
        "caches it for compile (--no-cache: not saved)",
    )  # fmt: skip


def _add_plan(commands: argparse._SubParsersAction) -> None:
    """`pdcompile plan`: cut a model into stages for a cluster."""
    plan = commands.add_parser(
        "plan",
        help="cut a model into pipeline stages for a cluster",
        description="Plan stages and replicas for a cluster; prints the stage table and the "
        "predicted speed-up over data parallelism on the same devices.",
    )
    _plan_options(plan, auto=True)
    plan.add_argument(
        "--allow-async", action="store_true",
        help="with --schedule auto, pipedream and 2bw are candidates too",
    )  # fmt: skip
    plan.add_argument(
        "--global-batch-size", type=int, metavar="G",
        help="rows per step: plan every microbatch count dividing G (with --schedule auto, "
        "for every schedule) and keep the fastest that fits",
    )  # fmt: skip
    plan.add_argument(
        "--recompute", choices=RECOMPUTE, default="auto",
        help="activation recomputation under --memory: auto (the planner decides per stage), "
        "on (every stage), off (never)",
    )  # fmt: skip
    plan.add_argument(
        "--measured", metavar="TRACE",
        help="re-plan from a recorded run (PipelinedModule.save_trace): its stages' measured "
        "times rescale INPUT's costs; prints the running plan and the new one, priced alike",
    )  # fmt: skip
    plan.add_argument("--solver", default="dynprog", help="a name from `pdcompile solvers`")
    plan.add_argument("--out", metavar="FILE", help="write the Plan JSON here")


def _add_codegen(commands: argparse._SubParsersAction) -> None:
    """`pdcompile codegen`: write one module per stage of a plan."""
    generate = commands.add_parser(
        "codegen",
        help="generate one module per pipeline stage and write their source",
        description="Capture SPEC, cut it into the stages of a plan (--plan FILE, or planned "
        "here for --cluster with analytic costs) and write stage_<i>.py per stage and "
        "program.json into --out; StagedProgram.load(DIR, model) rebuilds the program.",
    )
    generate.add_argument("spec", metavar="SPEC", help="package.module:factory or file.py:factory")
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--plan", metavar="FILE", help="a Plan JSON (pdcompile plan --out)")
    source.add_argument("--cluster", help="plan here for this cluster, e.g. 4 or 8@300GB/s")
    generate.add_argument("--costs", metavar="FILE", help="the CostGraph a coarsened plan used")
    generate.add_argument("--solver", help="with --cluster: a solver name (default dynprog)")
    generate.add_argument("--memory", help="with --cluster: bytes per device, e.g. 80GB")
    generate.add_argument(
        "--schedule", choices=list(schedules()), help="with --cluster (default 1f1b)"
    )
    generate.add_argument("--microbatches", type=int, help="with --cluster: per step")
    _chunks_option(generate, "with --cluster: ")
    generate.add_argument("--out", required=True, metavar="DIR", help="folder to write")
    _capture_options(generate)


def _add_simulate(commands: argparse._SubParsersAction) -> None:
    """`pdcompile simulate`: a plan's simulated step, Gantt chart and Chrome trace."""
    simulation = commands.add_parser(
        "simulate",
        help="simulate a plan's schedule: Gantt chart, Chrome trace, bubble and memory per rank",
        description="Simulate a training step of a plan (a Plan JSON, or planned here from "
        "anything `pdcompile plan` takes) and print the time per step and each rank's bubble "
        "and peak memory; draw the Gantt chart (--png, --svg), beside a measured run "
        "(--measured, a trace from PipelinedModule.save_trace), and write a Chrome trace "
        "(--trace) that Perfetto opens.",
    )
    _plan_options(simulation, plan_file=True)
    simulation.add_argument("--solver", help="planning INPUT: a solver name (default dynprog)")
    figure = simulation.add_mutually_exclusive_group()
    figure.add_argument("--png", metavar="FILE", help="draw the Gantt chart as a PNG")
    figure.add_argument("--svg", metavar="FILE", help="draw the Gantt chart as an SVG")
    simulation.add_argument("--trace", metavar="FILE", help="write the Chrome trace JSON here")
    simulation.add_argument(
        "--measured", metavar="TRACE",
        help="a measured run's trace (PipelinedModule.save_trace), drawn above the simulation",
    )  # fmt: skip


def _add_solvers(commands: argparse._SubParsersAction) -> None:
    """`pdcompile solvers`: list the registered solvers."""
    commands.add_parser("solvers", help="list the registered solvers")


def _add_bench_solvers(commands: argparse._SubParsersAction) -> None:
    """`pdcompile bench-solvers` (alias `compare`): solvers compared on instances."""
    bench = commands.add_parser(
        "bench-solvers",
        aliases=["compare"],
        help="run solvers on instances and compare them under pdcompile's cost model",
        description="Run every requested solver on every INPUT and cluster and print, under "
        "`evaluate`, each plan's predicted time, its ratio to the best, the lower bound, the "
        "gap and the solve time (a failure or a timeout is reported in its row), then a "
        "summary per solver. `compare` is the same command.",
    )
    bench.add_argument(
        "inputs", nargs="+", metavar="INPUT",
        help="PipeDream graph.txt or its folder (or a folder of them), costs.json, "
        "package.module:factory, or a synthetic chain:N[:SEED] / dag:N[:SEED]",
    )  # fmt: skip
    bench.add_argument(
        "--cluster", action="append", required=True,
        help="e.g. 16@1.25GB/s or 4@10GB/s,4@1.25GB/s; repeat for several clusters",
    )  # fmt: skip
    bench.add_argument("--memory", help="bytes per device, e.g. 16GB")
    bench.add_argument("--schedule", choices=list(schedules()), default="1f1b")
    bench.add_argument(
        "--schedules", metavar="A,B,...",
        help="comma-separated schedules (or auto) instead of --schedule: every (solver, "
        "schedule) pair plans the same instances, compared by simulated step time",
    )  # fmt: skip
    bench.add_argument("--microbatches", type=int, help="microbatches per step")
    _chunks_option(bench)
    bench.add_argument("--solvers", help="comma-separated names (default: every registered one)")
    bench.add_argument(
        "--plugin", action="append", default=[], metavar="MODULE",
        help="import this module (dotted name or file.py) first, for the solvers it registers; "
        "runs its code",
    )  # fmt: skip
    bench.add_argument(
        "--time-limit", type=float, default=60.0, metavar="SECONDS",
        help="per solver run, in a worker process (default 60; 0: no limit, in this process)",
    )  # fmt: skip
    bench.add_argument("--analytic", action="store_true", help="SPECs are costed analytically")
    bench.add_argument("--json", metavar="FILE", help="write the results as JSON here")
