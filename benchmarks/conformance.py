"""Conformance suite: every architecture of conformance_models.py through every phase.

python benchmarks/conformance.py [--only NAME ...] [--family F ...] [--profile] [--json out.json]
                                 [--markdown out.md]

Per architecture, in order (docs/conformance.md): trace; analyze (analytic costs, profiled with
--profile); plan on 2 and on 4 devices with the default solver and on 4 with `uniform` (4
stages); codegen of that 4-stage plan, whose stages in order must reproduce the model's outputs
and gradients; `compile` on 2 devices (`uniform`) with `1f1b`, whose loss and weights after 3
steps must equal single-process gradient accumulation over the same microbatches, and with
`pipedream`, whose 3 losses must be finite. A failing step records its error's type and first
line; a step whose prerequisite failed is skipped. Exits with 1 when a step did not pass.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from conformance_models import ARCHITECTURES, Architecture, Case
from rich.console import Console
from rich.table import Table

import pdcompile
import pdcompile.passes
import pdcompile.runtime
from pdcompile.core.errors import PdcompileError
from pdcompile.core.ir import iter_tensors

STEPS = ("trace", "analyze", "plan-2", "plan-4", "plan-uniform", "codegen", "1f1b", "pipedream")
NEEDS = {
    "analyze": "trace", "plan-2": "analyze", "plan-4": "analyze", "plan-uniform": "analyze",
    "codegen": "plan-uniform", "1f1b": "codegen", "pipedream": "codegen",
}  # fmt: skip
STEPS_TRAINED = 3
RTOL, ATOL = 1e-4, 1e-5
# where a failure arose: the repository's folders (pdcompile.passes lives in passes/, ...)
_CORE = {
    Path(pdcompile.__file__).parent: "pdcompile",
    Path(pdcompile.passes.__file__).parent: "passes",
    Path(pdcompile.runtime.__file__).parent: "runtime",
}


class Mismatch(AssertionError):
    """A phase ran but computed something else than the model (or its reference)."""


def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


@dataclass
class StepResult:
    status: str  # "ok", "failed" or "skipped"
    seconds: float = 0.0
    detail: str = ""  # what an ok step made (path and nodes, stages, losses)
    error: str = ""  # "Type: first line of the message"
    pdcompile_error: bool = False  # a PdcompileError subclass (a refusal), not a bare error
    origin: str = ""  # the innermost pdcompile/passes/runtime frame: "path:line in function"
    exception: BaseException | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "exception"}


def first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _origin(exc: BaseException) -> str:
    """Where the failure arose: the innermost pdcompile frame ("folder/file.py:line in f") of
    the deepest exception in the chain (a CostError's cause, say) that passed through pdcompile."""
    chain = [exc]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
        chain.append(cause)
    for error in reversed(chain):
        for frame in reversed(traceback.extract_tb(error.__traceback__)):
            path = Path(frame.filename)
            for root, label in sorted(_CORE.items(), key=lambda kv: -len(kv[0].parts)):
                if path.is_relative_to(root):
                    return f"{label}/{path.relative_to(root)}:{frame.lineno} in {frame.name}"
    return ""


def _run(results: dict[str, StepResult], step: str, work: Callable[[], str]) -> None:
    """Run one step unless its prerequisite failed; record ok, its error, or skipped."""
    need = NEEDS.get(step)
    if need is not None and results[need].status != "ok":
        results[step] = StepResult("skipped", detail=f"{need} {results[need].status}")
        return
    start = time.perf_counter()
    try:
        detail = work()
    except Exception as exc:  # one step's failure must not stop the others
        results[step] = StepResult(
            "failed", time.perf_counter() - start, error=first_line(exc),
            pdcompile_error=isinstance(exc, PdcompileError), origin=_origin(exc), exception=exc,
        )  # fmt: skip
    else:
        results[step] = StepResult("ok", time.perf_counter() - start, detail=detail)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise Mismatch(f"{what}: {actual.dtype}{list(actual.shape)} where the model gives "
                       f"{expected.dtype}{list(expected.shape)}")  # fmt: skip
    if not torch.allclose(actual, expected, rtol=RTOL, atol=ATOL):
        worst = (actual - expected).abs().max().item()
        raise Mismatch(f"{what} differs from the model's by up to {worst:.3g}")


def check_program(case: Case, program: pdcompile.StagedProgram) -> None:
    """The stages run in order give the model's outputs and, after `loss_fn`'s backward, the
    model's gradient for every parameter (a tied one summed over the stages holding a copy)."""
    model = case.model
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    model.zero_grad(set_to_none=True)
    expected = model(*case.example_inputs, **case.example_kwargs)
    case.loss_fn(expected, case.targets).backward()
    reference = {key: model.get_parameter(ns[0]).grad for key, ns in names.items()}
    model.zero_grad(set_to_none=True)
    for stage in program.stages:
        stage.zero_grad(set_to_none=True)
    actual = program(*case.example_inputs, **case.example_kwargs)
    if type(actual) is not type(expected):
        raise Mismatch(f"the program returns {type(actual).__name__}, the model "
                       f"{type(expected).__name__}")  # fmt: skip
    ours, theirs = dict(iter_tensors(actual)), dict(iter_tensors(expected))
    if ours.keys() != theirs.keys():
        raise Mismatch(f"the program returns {sorted(ours)}, the model {sorted(theirs)}")
    for path, tensor in ours.items():
        _close(tensor.detach(), theirs[path].detach(), f"output {path or '(the tensor)'}")
    case.loss_fn(actual, case.targets).backward()
    for key, ns in names.items():
        grads = []
        for stage in program.stages:
            held = dict(stage.named_parameters(remove_duplicate=False))
            copies = {id(held[n]): held[n] for n in ns if n in held}
            grads += [t.grad for t in copies.values() if t.grad is not None]
        if reference[key] is None:
            if grads:
                raise Mismatch(f"gradient of {ns[0]}: the model has none, the program has one")
        elif not grads:
            raise Mismatch(f"gradient of {ns[0]}: the program has none")
        else:
            _close(torch.stack(grads).sum(0), reference[key], f"gradient of {ns[0]}")
    model.zero_grad(set_to_none=True)


def _split(value: Any, parts: int) -> list[Any]:
    """As the runtime splits a batch: tensors along dim 0 (`tensor_split`), others copied."""
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, parts))
    return [value] * parts


def accumulate_reference(case: Case, model: torch.nn.Module, num_microbatches: int) -> float:
    """`STEPS_TRAINED` steps of single-process gradient accumulation over the microbatches the
    pipeline runs (each loss weighted by its share of the rows); returns the last step's loss."""
    opt = sgd(list(model.parameters()))
    args = [_split(a, num_microbatches) for a in case.example_inputs]
    kwargs = {k: _split(v, num_microbatches) for k, v in case.example_kwargs.items()}
    targets = _split(case.targets, num_microbatches)
    rows = case.targets.shape[0]
    loss = 0.0
    for _ in range(STEPS_TRAINED):
        loss = 0.0
        for i in range(num_microbatches):
            out = model(*[a[i] for a in args], **{k: v[i] for k, v in kwargs.items()})
            part = case.loss_fn(out, targets[i]) * (targets[i].shape[0] / rows)
            part.backward()
            loss += float(part.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss


def _compile(case: Case, model: torch.nn.Module, schedule: str) -> Any:
    return pdcompile.compile(
        model, case.example_inputs, example_kwargs=case.example_kwargs, loss_fn=case.loss_fn,
        optimizer=sgd, cluster="2", solver="uniform", schedule=schedule, profile=False,
    )  # fmt: skip


def _train(case: Case, pipe: Any) -> list[float]:
    return [pipe.train_step(case.example_inputs, case.targets, case.example_kwargs)
            for _ in range(STEPS_TRAINED)]  # fmt: skip


def run_architecture(arch: Architecture, *, profile: bool = False) -> dict[str, StepResult]:
    """Every step of `STEPS` on one architecture (each in its own try; see the module doc)."""
    results: dict[str, StepResult] = {}
    state: dict[str, Any] = {}

    def trace() -> str:
        case = state["case"] = arch.build()
        # compile's stages share, and train, the model's tensors: each run gets its own copy
        state["pristine"] = copy.deepcopy(case.model)
        gm = state["gm"] = pdcompile.trace(
            case.model, case.example_inputs, example_kwargs=case.example_kwargs
        )
        leaves = [name for name, _ in gm.meta.get("pdcompile.auto_leaves", ())]
        extra = ""
        if leaves:  # the largest share of the parameters one stage must hold whole
            total = sum(p.numel() for p in case.model.parameters())
            share = max(sum(p.numel() for p in case.model.get_submodule(n).parameters())
                        for n in leaves) / max(total, 1)  # fmt: skip
            extra = f", {len(leaves)} auto leaves (largest {share:.0%})"
        return f"{gm.meta['pdcompile.capture']}, {len(gm.graph.nodes)} nodes{extra}"

    def analyze() -> str:
        case = state["case"]
        costs = state["costs"] = pdcompile.analyze(
            state["gm"], case.example_inputs, example_kwargs=case.example_kwargs,
            profile=profile, progress=False,
        )  # fmt: skip
        return f"{costs.graph.number_of_nodes()} nodes"

    def planner(devices: str, solver: str) -> Callable[[], str]:
        def work() -> str:
            plan = pdcompile.plan(state["costs"], devices, solver=solver)
            state[f"plan-{solver}-{devices}"] = plan
            return "+".join(str(s.replicas) for s in plan.stages) + " replicas"

        return work

    def codegen() -> str:
        plan = state["plan-uniform-4"]
        if plan.num_stages != 4:
            raise Mismatch(f"uniform on 4 devices made {plan.num_stages} stages, not 4")
        program = pdcompile.codegen(state["gm"], plan)
        check_program(state["case"], program)
        return f"{len(program.channels)} channels"

    def one_f_one_b() -> str:
        case = state["case"]
        pipe = _compile(case, copy.deepcopy(state["pristine"]), "1f1b")
        losses = _train(case, pipe)
        reference = copy.deepcopy(state["pristine"])
        expected = accumulate_reference(case, reference, pipe.pipeline.num_microbatches)
        if not math.isclose(losses[-1], expected, rel_tol=RTOL, abs_tol=ATOL):
            raise Mismatch(f"loss after {STEPS_TRAINED} steps {losses[-1]:.6g}, gradient "
                           f"accumulation gives {expected:.6g}")  # fmt: skip
        trained = pipe.state_dict()
        for name, tensor in reference.state_dict().items():
            if name not in trained:
                raise Mismatch(f"the pipeline's state_dict lacks {name}")
            _close(trained[name], tensor, f"{name} after {STEPS_TRAINED} steps")
        return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"

    def pipedream() -> str:
        case = state["case"]
        pipe = _compile(case, copy.deepcopy(state["pristine"]), "pipedream")
        losses = _train(case, pipe)
        pipe.flush()
        if not all(math.isfinite(x) for x in losses):
            raise Mismatch(f"losses {losses} are not all finite")
        return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pdcompile.TraceWarning)  # automatic leaves: in "trace"
        _run(results, "trace", trace)
        _run(results, "analyze", analyze)
        _run(results, "plan-2", planner("2", "dp"))
        _run(results, "plan-4", planner("4", "dp"))
        _run(results, "plan-uniform", planner("4", "uniform"))
        _run(results, "codegen", codegen)
        _run(results, "1f1b", one_f_one_b)
        _run(results, "pipedream", pipedream)
    return results


def _cell(r: StepResult, width: int = 60) -> str:
    if r.status == "ok":
        return f"[green]ok[/] {r.seconds:.2f}s"
    if r.status == "skipped":
        return "[dim]skipped[/]"
    text = r.error if len(r.error) <= width else r.error[: width - 1] + "…"
    return f"[red]{text}[/]"


def markdown(rows: dict[str, dict[str, StepResult]], width: int = 70) -> str:
    """The table as Markdown: ok with seconds, skipped, or the error's first line."""
    header = ["model", "family", "graph", *STEPS]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for name, results in rows.items():
        graph = results["trace"].detail or "-"  # capture path and nodes
        cells = []
        for step in STEPS:
            r = results[step]
            if r.status == "ok":
                cells.append(f"ok {r.seconds:.1f}s")
            elif r.status == "skipped":
                cells.append("skipped")
            else:
                text = r.error.replace("|", "\\|")
                cells.append(text if len(text) <= width else text[: width - 1] + "…")
        family = ARCHITECTURES[name].family
        lines.append(f"| {name} | {family} | {graph} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=sorted(ARCHITECTURES))
    families = sorted({a.family for a in ARCHITECTURES.values()})
    parser.add_argument("--family", nargs="+", choices=families)
    parser.add_argument("--profile", action="store_true", help="measured costs in analyze")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--markdown", metavar="FILE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)  # deprecations inside torch and transformers
    names = args.only or [n for n, a in ARCHITECTURES.items()
                          if not args.family or a.family in args.family]  # fmt: skip
    console = Console(width=220)
    rows: dict[str, dict[str, StepResult]] = {}
    for name in names:
        start = time.perf_counter()
        rows[name] = run_architecture(ARCHITECTURES[name], profile=args.profile)
        ok = sum(r.status == "ok" for r in rows[name].values())
        console.print(f"{name}: {ok}/{len(STEPS)} ok in {time.perf_counter() - start:.1f} s")
    table = Table(title=f"conformance, torch {torch.__version__}, 1 thread", show_lines=True)
    table.add_column("model")
    for step in STEPS:
        table.add_column(step, overflow="fold")
    for name, results in rows.items():
        table.add_row(name, *(_cell(results[s]) for s in STEPS))
    console.print(table)
    failures = [(n, s, r) for n, res in rows.items() for s, r in res.items()]
    for name, step, r in [f for f in failures if f[2].status == "failed"]:
        kind = "refusal" if r.pdcompile_error else "bare error"
        console.print(f"{name} {step} ({kind}, {r.origin or 'outside pdcompile'}): {r.error}",
                      markup=False, highlight=False)  # fmt: skip
    total = len(rows) * len(STEPS)
    passed = sum(r.status == "ok" for res in rows.values() for r in res.values())
    console.print(f"{passed}/{total} steps ok over {len(rows)} architectures")
    if args.json:
        payload = {"torch": torch.__version__, "profile": args.profile,
                   "results": {n: {s: r.to_json() for s, r in res.items()}
                               for n, res in rows.items()}}  # fmt: skip
        Path(args.json).write_text(json.dumps(payload, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows) + "\n")
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
