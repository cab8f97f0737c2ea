"""Code generation time and per-stage node counts for the zoo's GPT-style decoder.

    python benchmarks/codegen.py

Plans of 2, 4 and 8 devices from `uniform` (one stage per device) and `dp` on analytic costs;
the median of 7 `codegen` runs each, and a check that the program computes the model's output.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
from rich.console import Console
from rich.table import Table

import pdcompile
from pdcompile import Cluster, zoo


def main() -> None:
    warnings.simplefilter("ignore")
    model, (tokens,) = zoo.gpt()
    model.eval()
    gm = pdcompile.trace(model, (tokens,))
    costs = pdcompile.analyze(gm, (tokens,), profile=False, device_model="cpu")
    table = Table(title=f"codegen of zoo.gpt ({len(gm.graph.nodes)} graph nodes), median of 7")
    for column in ("solver", "devices", "stages", "codegen", "computed nodes per stage", "equal"):
        table.add_column(column, justify="right")
    for solver in ("uniform", "dp"):
        for devices in (2, 4, 8):
            plan = pdcompile.plan(costs, Cluster.parse(str(devices)), solver=solver)
            times = []
            for _ in range(7):
                start = time.perf_counter()
                program = pdcompile.codegen(gm, plan)
                times.append(time.perf_counter() - start)
            with torch.no_grad():
                equal = torch.allclose(program(tokens), model(tokens))
            table.add_row(
                solver, str(devices), str(program.num_stages),
                f"{statistics.median(times) * 1e3:.1f} ms",
                str([len(s.nodes) for s in program.signatures]), str(equal),
            )  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
