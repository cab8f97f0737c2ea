"""The `pdcompile` command. Thin: every flag maps to an API argument.

pdcompile graph SPEC [--format txt|json|dot|svg|png] [--out FILE] [--leaf NAME ...]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

import torch.nn as nn
from rich.console import Console

from pdcompile.errors import PdcompileError, SpecError
from pdcompile.graph_report import render_dot, to_dot, to_json, to_table
from pdcompile.model_spec import load_model_spec
from pdcompile.tracing import METHODS, trace

FORMATS = ("txt", "json", "dot", "svg", "png")


def _leaf_modules(model: nn.Module, names: Sequence[str]) -> list[type[nn.Module] | str]:
    """`--leaf` values: a submodule's qualified name, else the class name of some submodule."""
    modules = dict(model.named_modules())
    types = {}
    for module in modules.values():
        cls = type(module)
        types.setdefault(cls.__name__, cls)
        types.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)
    return [name if name in modules or name not in types else types[name] for name in names]


def _graph(args: argparse.Namespace) -> int:
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
    name = type(spec.model).__name__
    if args.format == "txt":
        if args.out:
            with open(args.out, "w") as f:
                Console(file=f, width=200).print(to_table(gm, name))
        else:
            Console(width=None if sys.stdout.isatty() else 200).print(to_table(gm, name))
        return 0
    if args.format == "json":
        data: str | bytes = to_json(gm, name)
    elif args.format == "dot":
        data = to_dot(gm, name)
    else:
        if not args.out:
            raise PdcompileError(f"--format {args.format} writes a binary file: give --out FILE")
        data = render_dot(to_dot(gm, name), args.format)
    if args.out:
        with open(args.out, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
    else:
        sys.stdout.write(data)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdcompile", description="Pipeline-parallel training compiler for PyTorch."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True)
    graph = commands.add_parser(
        "graph",
        help="capture a model and show its graph",
        description="Capture a model and show its graph: one row per node with output shapes, "
        "bytes and the parameters it owns.",
    )
    graph.add_argument(
        "spec", metavar="SPEC", help="package.module:factory or path/file.py:factory"
    )
    graph.add_argument("--format", choices=FORMATS, default="txt")
    graph.add_argument("--out", metavar="FILE", help="write here instead of standard output")
    graph.add_argument(
        "--leaf",
        nargs="+",
        default=[],
        metavar="NAME",
        help="extra leaf modules: qualified names or class names",
    )
    graph.add_argument("--method", choices=METHODS, default="auto", help="capture path")
    graph.add_argument("--eval", action="store_true", help="capture the model in eval mode")
    graph.set_defaults(run=_graph)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pdcompile` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except PdcompileError as e:
        if args.debug:
            raise
        print(f"pdcompile: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, SpecError) else 1


if __name__ == "__main__":
    sys.exit(main())
