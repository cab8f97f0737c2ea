"""`pdcompile.analyze`: label every node with what it costs and derive the CostGraph."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx

from pdcompile.cost_graph import CostGraph
from pdcompile.errors import CostError, PdcompileError
from pdcompile.ir import (
    CAPTURE,
    FOLDED_S,
    FRAMEWORK,
    FRAMEWORK_OPS,
    FRAMEWORK_S,
    INPUTS,
    LOSS_S,
    OPTIMIZER,
    OPTIMIZER_CALL_S,
    OPTIMIZER_PRICED,
    PROFILE,
)
from pdcompile.passes.analytic import annotate_analytic
from pdcompile.passes.coarsening import coarsen as coarsen_layers
from pdcompile.passes.cost_view import to_cost_graph
from pdcompile.passes.device_model import DeviceModel
from pdcompile.passes.framework_cost import FrameworkCost, framework_cost
from pdcompile.passes.framework_fold import annotate_framework
from pdcompile.passes.memory import annotate_memory
from pdcompile.passes.profile import annotate_profile
from pdcompile.passes.step_costs import (
    OptimizerFactory,
    annotate_loss,
    annotate_optimizer,
    describe_optimizer,
)


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


def default_device_model(device: torch.device) -> DeviceModel:
    """The preset closest to `device`: `h100`/`a100` by CUDA device name, else `cpu`."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        return DeviceModel.get("h100" if "h100" in name or "h200" in name else "a100")
    return DeviceModel.get("cpu")


def analyze(
    gm: fx.GraphModule,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    profile: bool = True,
    device: str | torch.device | None = None,
    optimizer: str | OptimizerFactory = "sgd",
    device_model: str | DeviceModel | None = None,
    coarsen: int | None = None,
    cache: bool | str = True,
    num_threads: int = 1,
    progress: bool = True,
    calibration: bool | FrameworkCost | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    targets: Any = None,
    autocast: torch.dtype | None = None,
    loaded_by: int = 0,
) -> CostGraph:
    """Run the cost passes on a captured graph and return its CostGraph.

    Args:
        gm: a graph from `pdcompile.trace`.
        example_inputs, example_kwargs: the example call given to `trace`.
        profile: measure times on `device`; False prices nodes with `device_model` only (works
            for models on the meta device).
        device: where to profile (default: where the example inputs are). The graph is copied
            there; the model itself is never moved.
        optimizer: "sgd", "momentum" or "adam", or a factory `params -> torch.optim.Optimizer`
            (what `compile` takes): sizes the optimizer state and is the optimizer whose step
            prices each node's `optimizer_s` (timed on tensors of the node's parameter sizes;
            without profiling, the bytes it moves on the device model).
        device_model: preset name or DeviceModel for the analytic costs (default: nearest preset).
        coarsen: group nodes into at most this many layers.
        cache: profile cache: True (default directory), a directory, or False.
        num_threads: CPU threads while profiling.
        progress: show a progress bar while profiling.
        calibration: the per-operation framework cost folded into the node times
            (`pdcompile.calibrate`, docs/costs.md): True uses the one cached for this machine,
            device and thread count (profiling measures it when none is, in about a second;
            without profiling none is measured), a `FrameworkCost` that one, False none. None
            (the default): True when profiling, False otherwise.
        loss_fn, targets: `loss_fn(output, targets) -> scalar` and targets for the example's
            rows: the loss is timed on the graph's output (forward and backward; without
            profiling, its FLOPs and bytes on the device model) into the CostGraph's
            `loss_forward_s` and `loss_backward_s`. Without both the loss is not priced (0.0).
        autocast: the dtype `compile(autocast=)` runs forwards in: the activations are
            measured under `torch.autocast` (docs/memory.md); the weights stay fp32.
        loaded_by: how many other processes train on this machine while it profiles
            (`compile`'s other ranks do, as in the run: `runtime/profile_load.py`); recorded,
            and part of the cache keys, so a profile taken alone is not reused for a loaded
            one, nor the reverse.

    Returns:
        The CostGraph; its `meta` records the model, capture path, device, optimizer and source,
        and under `framework` the calibration folded in (None without).

    Raises:
        CostError: a pass failed (named) or an argument is wrong.

    Example:
        >>> model, inputs = pdcompile.zoo.mlp()
        >>> costs = pdcompile.analyze(pdcompile.trace(model, inputs), inputs)
        >>> costs.batch_size, len(costs.nodes)
        (4, 12)
    """
    inputs = graph_inputs(gm, example_inputs, example_kwargs)
    on_meta = any(p.device.type == "meta" for p in gm.parameters())
    target = torch.device(device) if device is not None else next(iter(inputs.values())).device
    if on_meta and device is None:
        target = torch.device("meta")  # weights without values: the inputs join them there
    if profile and target.type == "meta":
        raise CostError("a model on the meta device cannot be profiled; pass profile=False")
    if any(t.device != target for t in [*inputs.values(), *gm.parameters()]):
        gm = copy.deepcopy(gm).to(target)
        inputs = {k: v.to(target) for k, v in inputs.items()}
    model = DeviceModel.get(device_model) if device_model else default_device_model(target)
    if calibration is None:
        calibration = profile
    cost = framework_cost(calibration, target, num_threads, cache, measure=profile)

    kind = describe_optimizer(optimizer).kind  # the state optimizer_bytes counts
    passes: list[tuple[str, Callable[[], Any]]] = [
        ("memory", lambda: annotate_memory(gm, inputs, kind, loss_fn, targets, autocast)),
        ("analytic", lambda: annotate_analytic(gm, inputs, model)),
    ]
    if profile:
        passes.append(
            ("profile", lambda: annotate_profile(gm, inputs, num_threads=num_threads,
                                                 cache=cache, progress=progress,
                                                 loaded_by=loaded_by))
        )  # fmt: skip
    passes.append(
        ("optimizer", lambda: annotate_optimizer(gm, optimizer, target, profile=profile,
                                                 device_model=model, num_threads=num_threads,
                                                 cache=cache, loaded_by=loaded_by))
    )  # fmt: skip
    passes.append(
        ("loss", lambda: annotate_loss(gm, inputs, loss_fn, targets, profile=profile,
                                       device_model=model, num_threads=num_threads))
    )  # fmt: skip
    if cost is not None:
        passes.append(("framework", lambda: annotate_framework(gm, inputs, cost, measured=profile)))
    else:  # no times folded: what an earlier call folded must not reach this CostGraph
        for node in gm.graph.nodes:
            for key in (FOLDED_S, FRAMEWORK_S, FRAMEWORK_OPS):
                node.meta.pop(key, None)
        gm.meta.pop(FRAMEWORK, None)
    for name, run in passes:
        try:
            run()
        except PdcompileError:
            raise
        except Exception as e:
            raise CostError(_pass_failure(name, gm, e)) from e
        gm.graph.lint()

    batch = next(iter(inputs.values()))
    meta = {
        "model": type(gm).__name__,
        "capture": gm.meta.get(CAPTURE),
        "source": "profile" if profile else "analytic",
        "device": str(target),
        "device_model": model.name,
        "optimizer": gm.meta[OPTIMIZER],
        "num_threads": num_threads if profile and target.type == "cpu" else None,
        "torch_version": torch.__version__,
        # how, when and from which cache file the times came (`gm` is the graph profiled)
        "profile": dataclasses.asdict(gm.meta[PROFILE]) if profile else None,
        # the per-operation framework cost folded into the times, and how (framework_fold)
        "framework": gm.meta[FRAMEWORK].to_dict() if cost is not None else None,
    }
    graph = to_cost_graph(gm, batch.shape[0] if batch.dim() else 1, meta, measured=profile)
    graph.loss_forward_s, graph.loss_backward_s = gm.meta[LOSS_S] or (0.0, 0.0)
    graph.optimizer = gm.meta[OPTIMIZER_PRICED]
    graph.meta = {**graph.meta, "optimizer_call_s": gm.meta[OPTIMIZER_CALL_S]}
    return coarsen_layers(graph, coarsen) if coarsen else graph


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
