"""`pdcompile.analyze`: label every node with what it costs and derive the CostGraph.

The times are had at several row counts (`profiled_rows`: the example's rows, 1, and what the
caller will run), so that a microbatch of any size is priced from what was measured near it
(`pdcompile.core.row_curves`), not scaled linearly from one profile.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from pdcompile.compiling.analyze_config import AnalyzeConfig
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import CostError, PdcompileError
from pdcompile.core.generators import generators_kept
from pdcompile.core.ir import (
    BATCH_DIMS,
    CAPTURE,
    DEVICE_MODEL,
    FOLDED_S,
    FRAMEWORK,
    FRAMEWORK_OPS,
    FRAMEWORK_S,
    INPUTS,
    LOSS_S,
    OPTIMIZER,
    OPTIMIZER_CALL_S,
    OPTIMIZER_PRICED,
    OUTPUT_BYTES,
    OUTPUTS,
    PROFILE,
    graph_batch_size,
    input_batch_dim,
)
from pdcompile.core.progress import phase
from pdcompile.core.row_curves import monotone
from pdcompile.graph.shapes import annotate_shapes
from pdcompile.passes.analytic import annotate_analytic
from pdcompile.passes.coarsening import coarsen as coarsen_layers
from pdcompile.passes.cost_view import node_times, to_cost_graph
from pdcompile.passes.device_model import DeviceModel
from pdcompile.passes.framework_cost import FrameworkCost, framework_cost
from pdcompile.passes.framework_fold import annotate_framework
from pdcompile.passes.memory import annotate_memory
from pdcompile.passes.profile import annotate_profile
from pdcompile.passes.step_costs import (
    StepTiming,
    annotate_loss,
    annotate_optimizer,
    describe_optimizer,
)

# The largest row count profiled by default (unless the example has more): beyond it a
# microbatch's times follow the line through the two largest counts, where the work grows with
# the rows; profiling grows with the rows too.
ROW_CAP = 64
# A gap between two row counts profiled of this factor or more gets its geometric midpoint.
ROW_GAP = 16
# Warm-up and timed repeats at the row counts other than the example's (which keeps the
# profile's own): cheaper, as they only shape the curves between the example's times.
EXTRA_WARMUP, EXTRA_REPEATS = 2, 5


def graph_inputs(
    gm: fx.GraphModule, example_inputs: Any, example_kwargs: Mapping[str, Any] | None
) -> dict[str, torch.Tensor]:
    """The example call's tensors by graph input name (constants are already in the graph).

    Raises:
        CostError: a graph input has no tensor in the call.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    names = list(gm.meta.get(INPUTS) or [p.target for p in gm.graph.find_nodes(op="placeholder")])
    kwargs = dict(example_kwargs or {})
    positional = [v for v in example_inputs if isinstance(v, torch.Tensor)]
    found = {n: v for n, v in kwargs.items() if n in names and isinstance(v, torch.Tensor)}
    found.update(zip([n for n in names if n not in found], positional, strict=False))
    missing = [n for n in names if n not in found]
    if missing:
        raise CostError(
            f"no example tensor for graph input(s) {missing}; pass the example call given to "
            "pdcompile.trace (positional tensors in order, keyword tensors by name)"
        )
    return {n: found[n] for n in names}


def profiled_rows(
    batch: int, rows: Sequence[int] | None = None, max_rows: int | None = None
) -> tuple[int, ...]:
    """The row counts `analyze` times: `rows` when given (the example's `batch` always among
    them), else 1, `batch` and the largest microbatch the caller will run (`max_rows`, capped at
    `ROW_CAP` unless `batch` is larger), with the geometric midpoint of every gap of `ROW_GAP`
    times or more.

    Raises:
        CostError: `rows` holds something other than integers >= 1.

    >>> profiled_rows(4), profiled_rows(32), profiled_rows(4, max_rows=128)
    ((1, 4), (1, 6, 32), (1, 4, 16, 64))
    """
    if rows is not None:
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in rows):
            raise CostError(f"rows must be row counts (integers >= 1), got {rows!r}")
        return tuple(sorted({*rows, batch}))
    top = max(batch, min(max_rows or batch, ROW_CAP))
    points = sorted({1, batch, top})
    gaps = [round(math.sqrt(a * b)) for a, b in zip(points, points[1:], strict=False)
            if b >= ROW_GAP * a]  # fmt: skip
    return tuple(sorted({*points, *gaps}))


def with_rows(value: Any, rows: int, dims: Mapping[str, int | None] | None = None) -> Any:
    """`value` (a tensor, or a structure of them) with `rows` rows: every tensor with a batch
    dimension cut along it (dim 0, or `dims[key]` for a dict's entry: None leaves it whole), as
    the runtime cuts a batch into microbatches (`runtime.microbatches.split_batch`), its rows
    repeated in turn where `rows` exceeds its own; other values as they are."""

    def cut(t: Any, dim: int | None = 0) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or dim is None:
            return t
        have = t.shape[dim]
        if rows > have:
            t = torch.cat([t] * -(-rows // have), dim=dim)
        return t.narrow(dim, 0, rows)

    if dims and isinstance(value, Mapping):
        return {k: cut(v, dims.get(k, 0)) for k, v in value.items()}
    return pytree.tree_map(cut, value)


def default_device_model(device: torch.device) -> DeviceModel:
    """The preset closest to `device`: `h100`/`a100` by CUDA device name, else `cpu`."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        return DeviceModel.get("h100" if "h100" in name or "h200" in name else "a100")
    return DeviceModel.get("cpu")


def analyze(gm: fx.GraphModule, example_inputs: Any, **options: Any) -> CostGraph:
    """Run the cost passes on a captured graph and return its CostGraph.

    Args:
        gm: a graph from `pdcompile.trace`.
        example_inputs: the example call's positional inputs given to `trace`.
        options: `AnalyzeConfig`'s fields (documented there): `example_kwargs`, `profile`,
            `device`, `optimizer`, `device_model`, `coarsen`, `cache`, `num_threads`,
            `progress`, `calibration`, `loss_fn`, `targets`, `autocast`, `loaded_by`, `rows`,
            `max_rows`.

    Returns:
        The CostGraph; its `meta` records the model, capture path, device, optimizer and source,
        and under `framework` the calibration folded in (None without).

    Raises:
        CostError: a pass failed (named) or an argument is wrong.

    Example:
        >>> model, inputs = pdcompile.zoo.mlp()
        >>> costs = pdcompile.analyze(pdcompile.trace(model, inputs), inputs)
        >>> costs.batch_size, len(costs.nodes), costs.rows
        (4, 12, (1, 4))
    """
    config = AnalyzeConfig(**options)
    progress = phase(f"analyzing {len(gm.graph.nodes)} nodes", enabled=config.progress)
    device = config.device or next((p.device for p in gm.parameters()), None)
    with progress, generators_kept(device):  # the profile's runs draw no dropout masks
        passes = _Passes.on(gm, example_inputs, config)
        gm, inputs, targets = passes.gm, passes.inputs, config.targets
        size = graph_batch_size(gm)
        placeholders = gm.graph.find_nodes(op="placeholder")
        batched = any(input_batch_dim(gm, n) is not None for n in placeholders)
        counts = profiled_rows(size, config.rows, config.max_rows) if batched else (size,)
        # the other row counts first: the example's passes run last, so `gm`'s meta is theirs
        curves = {n: _at_rows(gm, n, inputs, targets, passes.timing, config.profile)
                  for n in counts if n != size}  # fmt: skip
        _run(gm, passes.example())
        curves[size] = (node_times(gm, measured=config.profile), gm.meta[LOSS_S] or (0.0, 0.0),
                        None)  # fmt: skip
        for n, (_, _, how) in sorted(curves.items()):  # the example's rows ran: the others' faults
            if how and "left_out" in how:
                warnings.warn(
                    f"costs at {n} rows per microbatch were not measured ({how['left_out']}); they "
                    "follow the other row counts (analyze(rows=...) chooses them)",
                    stacklevel=2,
                )
        graph = passes.cost_graph(size, curves)
        return coarsen_layers(graph, config.coarsen) if config.coarsen else graph


# per row count: the node times (None: left out), the loss's, and how they were had
Curves = dict[int, tuple[dict[str, tuple[float, ...]] | None, tuple[float, float], Any]]


@dataclass(frozen=True)
class _Passes:
    """The cost passes of one `analyze` call: on `gm` and `inputs` (copied to `target`), with
    the device model, the framework cost folded in (None: none) and the optimizer's kind."""

    gm: fx.GraphModule
    inputs: dict[str, torch.Tensor]
    config: AnalyzeConfig
    target: torch.device
    model: DeviceModel
    cost: FrameworkCost | None
    kind: str

    @classmethod
    def on(cls, gm: fx.GraphModule, example_inputs: Any, config: AnalyzeConfig) -> _Passes:
        """The passes on the example call, the graph moved to where it is profiled (or the
        meta device, for weights without values).

        Raises:
            CostError: a meta-device model asked to be profiled, or as `graph_inputs`.
        """
        inputs = graph_inputs(gm, example_inputs, config.example_kwargs)
        on_meta = any(p.device.type == "meta" for p in gm.parameters())
        device = config.device
        target = torch.device(device) if device is not None else next(iter(inputs.values())).device
        if on_meta and device is None:
            target = torch.device("meta")  # weights without values: the inputs join them there
        if config.profile and target.type == "meta":
            raise CostError("a model on the meta device cannot be profiled; pass profile=False")
        if any(t.device != target for t in [*inputs.values(), *gm.parameters()]):
            gm = copy.deepcopy(gm).to(target)
            inputs = {k: v.to(target) for k, v in inputs.items()}
        model = (DeviceModel.get(config.device_model) if config.device_model
                 else default_device_model(target))  # fmt: skip
        calibration = config.profile if config.calibration is None else config.calibration
        cost = framework_cost(calibration, target, config.num_threads, config.cache,
                              measure=config.profile)  # fmt: skip
        if cost is None:  # no times folded: what an earlier call folded must not reach this one
            for node in gm.graph.nodes:
                for key in (FOLDED_S, FRAMEWORK_S, FRAMEWORK_OPS):
                    node.meta.pop(key, None)
            gm.meta.pop(FRAMEWORK, None)
        kind = describe_optimizer(config.optimizer).kind  # the state optimizer_bytes counts
        return cls(gm, inputs, config, target, model, cost, kind)

    def timing(
        self, at: Mapping[str, torch.Tensor], at_targets: Any, warmup: int, repeats: int
    ) -> list[tuple[str, Callable[[], Any]]]:
        """The passes whose times depend on the rows, on inputs `at`."""
        gm, c, model = self.gm, self.config, self.model
        passes: list[tuple[str, Callable[[], Any]]] = [
            ("analytic", lambda: annotate_analytic(gm, at, model))
        ]
        if c.profile:
            passes.append(
                ("profile", lambda: annotate_profile(gm, at, num_threads=c.num_threads,
                                                     warmup=warmup, repeats=repeats,
                                                     cache=c.cache, progress=c.progress,
                                                     loaded_by=c.loaded_by))
            )  # fmt: skip
        timed = StepTiming(c.profile, model, c.num_threads, warmup, repeats)
        passes.append(("loss", lambda: annotate_loss(gm, at, c.loss_fn, at_targets, timed)))
        if self.cost is not None:
            cost = self.cost
            fold = lambda: annotate_framework(gm, at, cost, measured=c.profile)  # noqa: E731
            passes.append(("framework", fold))
        return passes

    def example(self) -> list[tuple[str, Callable[[], Any]]]:
        """Every pass, on the example's rows."""
        gm, c, inputs = self.gm, self.config, self.inputs
        timed = StepTiming(c.profile, self.model, c.num_threads, cache=c.cache,
                           loaded_by=c.loaded_by)  # fmt: skip
        return [
            ("memory", lambda: annotate_memory(gm, inputs, self.kind, c.loss_fn, c.targets,
                                               c.autocast)),
            ("optimizer", lambda: annotate_optimizer(gm, c.optimizer, self.target, timed)),
            *self.timing(inputs, c.targets, 3, 10),
        ]  # fmt: skip

    def cost_graph(self, size: int, curves: Curves) -> CostGraph:
        """The CostGraph of the graph as the example's passes left it, with each node's and the
        loss's times at every row count measured (made non-decreasing in the rows)."""
        gm, c = self.gm, self.config
        measured = sorted(n for n, curve in curves.items() if curve[0] is not None)
        keep = measured.index(size)
        row_s = None
        if len(measured) > 1:  # each time made non-decreasing in the rows, the example's kept
            row_s = {
                node: tuple(zip(*(monotone([curves[n][0][node][k] for n in measured], keep)
                                  for k in range(4)), strict=True))
                for node in curves[size][0]
            }  # fmt: skip
        graph = to_cost_graph(gm, size, self.meta(size, curves), measured=c.profile,
                              rows=tuple(measured), row_s=row_s)  # fmt: skip
        graph.loss_forward_s, graph.loss_backward_s = curves[size][1]
        if row_s is not None and c.loss_fn is not None and c.targets is not None:
            graph.loss_row_s = tuple(zip(*(monotone([curves[n][1][k] for n in measured], keep)
                                           for k in range(2)), strict=True))  # fmt: skip
        graph.optimizer = gm.meta[OPTIMIZER_PRICED]
        graph.meta = {**graph.meta, "optimizer_call_s": gm.meta[OPTIMIZER_CALL_S]}
        return graph

    def meta(self, size: int, curves: Curves) -> dict[str, Any]:
        """The CostGraph's `meta`: what was costed, where, how, and from which cache file."""
        gm, profile, target = self.gm, self.config.profile, self.target
        return {
            "model": type(gm).__name__,
            "capture": gm.meta.get(CAPTURE),
            "source": "profile" if profile else "analytic",
            "device": str(target),
            "device_model": self.model.name,
            "optimizer": gm.meta[OPTIMIZER],
            "num_threads": self.config.num_threads if profile and target.type == "cpu" else None,
            "torch_version": torch.__version__,
            # how, when and from which cache file the times came (`gm` is the graph profiled)
            "profile": dataclasses.asdict(gm.meta[PROFILE]) if profile else None,
            # the per-operation framework cost folded into the times, and how (framework_fold)
            "framework": gm.meta[FRAMEWORK].to_dict() if self.cost is not None else None,
            # the other row counts: how each was had, or why it was left out
            "row_profiles": {str(n): c[2] for n, c in sorted(curves.items()) if n != size},
        }


def _run(gm: fx.GraphModule, passes: list[tuple[str, Callable[[], Any]]]) -> None:
    """Run `passes` in order, linting the graph after each; a failure is a CostError naming the
    pass (and the node, where known)."""
    for name, run in passes:
        try:
            run()
        except PdcompileError:
            raise
        except Exception as e:
            raise CostError(_pass_failure(name, gm, e)) from e
        gm.graph.lint()


def _at_rows(
    gm: fx.GraphModule,
    rows: int,
    inputs: Mapping[str, torch.Tensor],
    targets: Any,
    timing: Callable[..., list[tuple[str, Callable[[], Any]]]],
    profile: bool,
) -> tuple[dict[str, tuple[float, ...]] | None, tuple[float, float], dict[str, Any]]:
    """The node times and the loss's at `rows` rows (the example's rows cut or repeated, as the
    runtime cuts a batch), and how they were had; (None, ..., {"left_out": why}) when the model
    cannot run there. The graph's output shapes are the example's again afterwards."""
    dims = dict(gm.meta.get(BATCH_DIMS, ()))
    at, at_targets = with_rows(dict(inputs), rows, dims), with_rows(targets, rows)
    shapes = {n: (n.meta[OUTPUTS], n.meta[OUTPUT_BYTES]) for n in gm.graph.nodes}
    try:
        annotate_shapes(gm, at)
        _run(gm, timing(at, at_targets, EXTRA_WARMUP, EXTRA_REPEATS))
        times = node_times(gm, measured=profile)
        loss = gm.meta[LOSS_S] or (0.0, 0.0)
    except Exception as e:  # the other counts still give the curves (analyze warns)
        why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        return None, (0.0, 0.0), {"left_out": why}
    finally:
        for node, (outputs, nbytes) in shapes.items():
            node.meta[OUTPUTS], node.meta[OUTPUT_BYTES] = outputs, nbytes
    if not profile:
        return times, loss, {"priced": gm.meta[DEVICE_MODEL].name}
    settings = gm.meta[PROFILE]
    return times, loss, {"repeats": settings.repeats, "cached": settings.cached,
                         "measured_at": settings.measured_at,
                         "unsettled": len(settings.unsettled)}  # fmt: skip


def _pass_failure(name: str, gm: fx.GraphModule, error: Exception) -> str:
    """What failed, at which node (fx's "While executing" note, else the innermost `node` the
    pass was working on when it raised), and the way out."""
    text = str(error).strip()
    node = _failing_node(gm, error, text)
    where, remedy = (
        "",
        (
            "the cost passes run every node again, alone, on the example's values; "
            "capture the model with pdcompile.trace (it rewrites in-place operations) and pass "
            "example inputs the model accepts"
        ),
    )
    if node is not None:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        what = type(module).__name__ if module is not None else f"{node.op} {node.target}"
        where = f" at node {node.name} ({what})"
        if module is not None:
            remedy = (
                f"the cost passes run every node again on the values of the example: leaf "
                f"module {node.target!r} must compute the same way on every call (no state that "
                "changes between calls); trace through it (leave it out of leaf_modules) or make "
                "it repeatable"
            )
    return (
        f"cost pass {name!r} failed on {type(gm).__name__}{where}: {type(error).__name__}: "
        f"{(text.splitlines() or [''])[0]}; {remedy}"
    )


def _failing_node(gm: fx.GraphModule, error: Exception, text: str) -> fx.Node | None:
    match = re.search(r"While executing %(\w+)", text)
    if match:
        return next((n for n in gm.graph.nodes if n.name == match.group(1)), None)
    found, tb = None, error.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("node")
        if isinstance(candidate, fx.Node) and candidate.graph is gm.graph:
            found = candidate
        tb = tb.tb_next
    return found
