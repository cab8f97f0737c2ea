"""Profiling: measured forward and backward time of every node, medians over repeats.

Every compute node runs alone on the values a full forward pass produced: its forward (autograd
on, as in training) is timed `warmup + repeats` times, then its backward (`torch.autograd.grad`
from its outputs to its inputs and parameters, graph retained) likewise, and the medians of the
repeats are kept. On CPU the wall clock times it at a fixed thread count (one by default); on CUDA,
CUDA events do. Placeholders, parameters (`get_attr`) and the output cost nothing.

Results are cached in a JSON file keyed by the graph's code and modules, input shapes, device,
thread count, torch version and the timing settings, so a second run on the same model is instant.
The cache lives in `$PDCOMPILE_CACHE_DIR` or `~/.cache/pdcompile`.

Reads `pdcompile.outputs`. Writes `pdcompile.measured_s` (`(forward, backward)` seconds) on
every node and `gm.meta["pdcompile.profile"]` (the `ProfileSettings`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.fx as fx
from rich.progress import Progress

from pdcompile.ir import MEASURED_S, OUTPUTS, PROFILE
from pdcompile.passes.node_runner import (
    COMPUTE_OPS,
    NodeCall,
    differentiable_outputs,
    invoke,
    record_values,
)
from pdcompile.passes.state import preserved_state

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileSettings:
    """How a profile was measured; part of the cache key."""

    device: str
    num_threads: int
    warmup: int
    repeats: int
    torch_version: str
    cached: bool = False


def default_cache_dir() -> Path:
    return Path(os.environ.get("PDCOMPILE_CACHE_DIR") or Path.home() / ".cache" / "pdcompile")


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":

        def cuda_time(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return cuda_time

    def wall_time(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return wall_time


def _median_time(timer: Callable, fn: Callable[[], object], warmup: int, repeats: int) -> float:
    times = [timer(fn) for _ in range(warmup + repeats)]
    return statistics.median(times[warmup:])


def _cache_key(
    gm: fx.GraphModule, inputs: Mapping[str, torch.Tensor], settings: ProfileSettings
) -> str:
    nodes = []
    for node in gm.graph.nodes:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        nodes.append(
            [node.name, node.op, str(node.target), repr(module), str(node.meta.get(OUTPUTS))]
        )
    shapes = {k: [list(v.shape), str(v.dtype)] for k, v in inputs.items()}
    fields = [gm.code, nodes, shapes, gm.training, asdict(settings)]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _load_cached(path: Path, key: str) -> dict[str, list[float]] | None:
    try:
        doc = json.loads(path.read_text())
        if doc.get("key") == key:
            return {name: list(pair) for name, pair in doc["nodes"].items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable profile cache %s (%s); profiling again", path, e)
    return None


class _TimedInterpreter(fx.Interpreter):
    """Runs the whole graph, timing each compute node in its real context."""

    def __init__(self, gm: fx.GraphModule, timer: Callable) -> None:
        super().__init__(gm)
        self.timer = timer
        self.times: dict[str, float] = {}

    def run_node(self, n: fx.Node) -> object:
        if n.op not in COMPUTE_OPS:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        module = self.module.get_submodule(n.target) if n.op == "call_module" else None
        result: list[object] = []
        self.times[n.name] = self.timer(lambda: result.append(invoke(n, module, args, kwargs)))
        return result[0]


def _isolated_backward(
    gm: fx.GraphModule, values: dict, node: fx.Node, timer: Callable, warmup: int, repeats: int
) -> float:
    call = NodeCall(gm, node, values)
    args, kwargs, targets = call.inputs()
    with torch.enable_grad():
        outputs = differentiable_outputs(call.forward(args, kwargs))
    if not (outputs and targets):
        return 0.0
    grads = [torch.ones_like(t) for t in outputs]
    return _median_time(
        timer,
        lambda: torch.autograd.grad(outputs, targets, grads, retain_graph=True, allow_unused=True),
        warmup,
        repeats,
    )


def _grad_call_overhead(device: torch.device, timer: Callable, repeats: int) -> float:
    """The fixed cost of one isolated `torch.autograd.grad` call (its fastest run over a view, whose
    backward does no work), which a whole backward pass pays once, not once per node."""
    x = torch.ones(1, device=device, requires_grad=True)
    with torch.enable_grad():
        y = x.view_as(x)
    grad = torch.ones_like(y)
    return min(
        timer(lambda: torch.autograd.grad(y, x, grad, retain_graph=True)) for _ in range(repeats)
    )


def _backward_time(timer: Callable, outputs: list[torch.Tensor]) -> float:
    grads = [torch.ones_like(t) for t in outputs]
    return timer(lambda: torch.autograd.backward(outputs, grads)) if outputs else 0.0


def _measure(
    gm: fx.GraphModule,
    inputs: Mapping[str, torch.Tensor],
    device: torch.device,
    warmup: int,
    repeats: int,
    progress: bool,
) -> dict[str, list[float]]:
    timer = _timer(device)
    args = [inputs[p.target] for p in gm.graph.find_nodes(op="placeholder")]
    nodes = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    forward: dict[str, list[float]] = {n.name: [] for n in nodes}
    backward_totals: list[float] = []
    params = [p for p in gm.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    for p in params:  # autograd would accumulate into the user's gradients in place
        p.grad = None
    with Progress(transient=True, disable=not progress) as bar, preserved_state(gm):
        task = bar.add_task(f"profiling {len(nodes)} nodes", total=warmup + repeats + len(nodes))
        for i in range(warmup + repeats):
            interpreter = _TimedInterpreter(gm, timer)
            with torch.enable_grad():
                outputs = differentiable_outputs(interpreter.run(*args))
            backward_s = _backward_time(timer, outputs)
            for p in params:
                p.grad = None
            if i >= warmup:
                backward_totals.append(backward_s)
                for name, seconds in interpreter.times.items():
                    forward[name].append(seconds)
            bar.advance(task)
        values = record_values(gm, inputs)
        overhead = _grad_call_overhead(device, timer, warmup + repeats)
        isolated = {}
        for node in nodes:
            measured = _isolated_backward(gm, values, node, timer, warmup, repeats)
            isolated[node.name] = max(measured - overhead, 0.0) if measured else 0.0
            bar.advance(task)
    for p, grad in zip(params, saved_grads, strict=True):
        p.grad = grad
    # The whole backward, measured in context, is shared out in proportion to the isolated runs.
    scale = statistics.median(backward_totals) / (math.fsum(isolated.values()) or 1.0)
    return {n: [statistics.median(forward[n]), isolated[n] * scale] for n in forward}


def annotate_profile(
    gm: fx.GraphModule,
    inputs: Mapping[str, torch.Tensor],
    *,
    num_threads: int = 1,
    warmup: int = 3,
    repeats: int = 10,
    cache: bool | str | Path = True,
    progress: bool = True,
) -> fx.GraphModule:
    """Measure every node's forward and backward time on the device of `inputs`.

    Args:
        gm: a captured graph whose parameters live on the same device as `inputs`.
        inputs: the graph's tensor inputs by name.
        num_threads: CPU threads during profiling (restored afterwards).
        warmup, repeats: untimed and timed runs of each forward and backward.
        cache: True for the default cache directory, a directory, or False for no cache.
        progress: show a rich progress bar.

    Returns:
        `gm`, annotated.
    """
    device = next(iter(inputs.values())).device
    settings = ProfileSettings(str(device), num_threads, warmup, repeats, torch.__version__)
    key = _cache_key(gm, inputs, settings)
    path = None
    if cache:
        directory = default_cache_dir() if cache is True else Path(cache)
        path = directory / f"profile-{key[:24]}.json"
    results = _load_cached(path, key) if path else None
    if results is None:
        threads = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            results = _measure(gm, inputs, device, warmup, repeats, progress)
        finally:
            torch.set_num_threads(threads)
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "settings": asdict(settings), "nodes": results}))
            tmp.replace(path)
    else:
        settings = ProfileSettings(**{**asdict(settings), "cached": True})
    for node in gm.graph.nodes:
        node.meta[MEASURED_S] = tuple(results.get(node.name, (0.0, 0.0)))
    gm.meta[PROFILE] = settings
    return gm
