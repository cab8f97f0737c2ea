"""What a training step costs outside the graph's nodes: the loss function and the optimizer step.

**The loss.** The graph runs once on the example (no gradients); its floating outputs become
leaves that require grad, as the last stage's outputs are, and `loss_fn(output, targets)` is
timed: its forward (autograd recording) and its backward (`torch.autograd.grad` to those
leaves, less the fixed cost of a grad call, which the stage's one backward pays once), medians
of `repeats` after `warmup`, at `num_threads` CPU threads. Without profiling (`profile=False`,
the `meta` device) it is priced like a node: FLOPs from `flop_counter`, bytes moved as the sum
of every ATen operation's tensor inputs and outputs, through the device model's roofline.

**The optimizer step.** Per node, one `step()` and `zero_grad(set_to_none=True)` (what a
stage's update runs, `runtime/worker.py`) of the very optimizer (a name, or the factory
`compile` was given) built on fresh tensors of the sizes and dtypes of the trainable
parameters the node owns (a tied one: its first user), gradients set and the caches overwritten
before each repeat (a stage's step finds its weights and state pushed out by the step's
forwards and backwards: timed warm, an SGD step with momentum was 1.3-2x too fast). The
optimizer's fixed cost per `step()` call (`call_s`: fitted over steps of 1 to 16 one-element
tensors) is taken off each node, so that a stage's sum of its nodes counts the tensors' work
and not one call per node; the stage's one call is priced once, from the CostGraph's
`meta["optimizer_call_s"]` (`evaluation.price`).
**The gradients' accumulation.** Every microbatch of an update after its first adds each
parameter's gradient to the one it holds (autograd's `AccumulateGrad`: `grad += new`), a cost
per microbatch whatever its rows, which a profile (its gradients set to None before each
backward) does not hold: per node, the median of those adds over fresh tensors of its
parameters' sizes, warm (the new gradient was just computed); without profiling, three times
their bytes over the memory bandwidth plus the per-operation overhead per tensor.
Nodes with the same tensor sizes are timed once, and the times are cached per optimizer,
device, thread count and torch version (`optimizer-<key>.json` beside the profile cache), so a
second analysis prices the step the same. Without profiling: the bytes the update reads and
writes (weights, gradients and state read; weights and state written) over the device model's
memory bandwidth, plus its per-operation overhead per tensor.

Reads `gm.meta["pdcompile.param_table"]`. Writes `pdcompile.optimizer_s` and
`pdcompile.accumulate_s` (float seconds) on every node, and `gm.meta["pdcompile.loss_s"]`
(`(forward, backward)` seconds per batch, or None when no loss was given),
`gm.meta["pdcompile.optimizer_priced"]` (the optimizer's name) and
`gm.meta["pdcompile.optimizer_call_s"]` (its fixed seconds per `step()` call; 0.0 modelled).
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pdcompile.core.errors import CostError
from pdcompile.core.ir import (
    ACCUMULATE_S,
    LOSS_S,
    OPTIMIZER_CALL_S,
    OPTIMIZER_PRICED,
    OPTIMIZER_S,
    PARAM_TABLE,
    iter_tensors,
)
from pdcompile.core.regular_file import read_regular_text
from pdcompile.graph.state import preserved_state
from pdcompile.passes.device_model import DeviceModel
from pdcompile.passes.flop_rules import flop_counter
from pdcompile.passes.profile_cache import default_cache_dir
from pdcompile.passes.timing import cache_evictor, device_timer, grad_call_overhead

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
# The optimizers `analyze(optimizer=...)` names, as `compile` users would build them.
KINDS: dict[str, OptimizerFactory] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}
_STATE_KINDS = ("sgd", "momentum", "adam")  # by state tensors per parameter: 0, 1, 2 or more
_CACHE_FORMAT = 3  # 3: the gradients' accumulation too


def optimizer_factory(optimizer: str | OptimizerFactory) -> OptimizerFactory:
    """The factory for a name of `KINDS`, or `optimizer` itself.

    Raises:
        CostError: neither a known name nor a callable.
    """
    if callable(optimizer):
        return optimizer
    if optimizer not in KINDS:
        raise CostError(
            f"optimizer must be one of {sorted(KINDS)} or a factory params -> "
            f"torch.optim.Optimizer, got {optimizer!r}"
        )
    return KINDS[optimizer]


@dataclass(frozen=True)
class OptimizerInfo:
    """What an optimizer is for the cost passes: `name` for people (and the CostGraph's
    `optimizer`), `kind` the state it keeps ("sgd": none, "momentum": one copy of the
    parameters, "adam": two), which sizes `optimizer_bytes`, and `key`, every setting, which
    keys the cache of its step times."""

    name: str
    kind: str
    key: str


def describe_optimizer(optimizer: str | OptimizerFactory) -> OptimizerInfo:
    """`OptimizerInfo` of `optimizer`: a name of `KINDS` is its own name and kind; a factory is
    built on one tiny tensor and stepped once, and named by its class and main hyper-parameters
    ("AdamW(lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01)"), its kind by the state
    tensors it keeps per parameter (none: "sgd", one: "momentum", two or more: "adam").

    Raises:
        CostError: an unknown name; a factory that fails on one tensor or does not return an
            optimizer.
    """
    if not callable(optimizer):
        optimizer_factory(optimizer)  # raises for unknown names
        return OptimizerInfo(optimizer, optimizer, optimizer)
    param = torch.nn.Parameter(torch.zeros(3))
    try:
        built = optimizer([param])
        param.grad = torch.ones(3)
        built.step()
    except Exception as e:
        raise CostError(
            f"the optimizer factory failed on one parameter tensor ({type(e).__name__}: {e}); "
            "pass a factory params -> torch.optim.Optimizer, as compile takes"
        ) from e
    if not isinstance(built, torch.optim.Optimizer):
        raise CostError(
            f"the optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer"
        )
    state = built.state.get(param, {})
    count = sum(1 for v in state.values() if isinstance(v, torch.Tensor) and v.shape == (3,))
    shown = ("lr", "momentum", "betas", "eps", "weight_decay", "nesterov", "amsgrad")
    settings = ", ".join(f"{k}={built.defaults[k]!r}" for k in shown if k in built.defaults)
    every = sorted((k, repr(v)) for k, v in built.defaults.items())
    cls = type(built)
    return OptimizerInfo(
        f"{cls.__name__}({settings})", _STATE_KINDS[min(count, 2)],
        f"{cls.__module__}.{cls.__qualname__}{every}",
    )  # fmt: skip


@dataclass(frozen=True)
class StepTiming:
    """How the optimizer step and the loss are priced: timed (`profile`: `repeats` after
    `warmup`, at `num_threads` CPU threads, as the profile's; `cache`: True, the profile cache's
    directory, a directory, or False; `loaded_by`: other processes training on this machine
    meanwhile, which keys the cache), else on `device_model`'s roofline."""

    profile: bool
    device_model: DeviceModel
    num_threads: int = 1
    warmup: int = 3
    repeats: int = 10
    cache: bool | str | Path = True
    loaded_by: int = 0


# -- the optimizer step ----------------------------------------------------------------------


def annotate_optimizer(
    gm: fx.GraphModule,
    optimizer: str | OptimizerFactory,
    device: torch.device,
    timing: StepTiming,
) -> fx.GraphModule:
    """Write `pdcompile.optimizer_s` and `pdcompile.accumulate_s` on every node and
    `gm.meta["pdcompile.optimizer_priced"]`.

    Args:
        gm: a captured graph with its parameter table.
        optimizer: a name of `KINDS` or a factory `params -> torch.optim.Optimizer`.
        device: where the parameters live (timed there when `timing.profile`).
        timing: timed, or priced on the device model.
    """
    info = describe_optimizer(optimizer)
    sizes = _owned_sizes(gm)
    call_s = 0.0
    if timing.profile:
        t = timing
        where = (device, t.num_threads, t.warmup, t.repeats, t.loaded_by)
        times, adds, call_s = _timed_steps(optimizer, info, sizes, where, t.cache)
    else:
        state = {"sgd": 0, "momentum": 1, "adam": 2}[info.kind]
        model = timing.device_model
        times = {key: _modelled_step(key, state, model) for key in set(sizes.values())}
        adds = {key: _modelled_accumulate(key, model) for key in set(sizes.values())}
    for node in gm.graph.nodes:
        key = sizes.get(node.name)
        node.meta[OPTIMIZER_S] = float(times[key]) if key else 0.0
        node.meta[ACCUMULATE_S] = float(adds[key]) if key else 0.0
    gm.meta[OPTIMIZER_PRICED] = info.name
    gm.meta[OPTIMIZER_CALL_S] = float(call_s) if sizes else 0.0
    return gm


Sizes = tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of each tensor a node owns


def _owned_sizes(gm: fx.GraphModule) -> dict[str, Sizes]:
    """node -> the shapes and dtypes of the trainable parameters it owns (its first use)."""
    owned: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    for info in gm.meta.get(PARAM_TABLE, ()):
        if info.is_buffer or not info.requires_grad or not info.users:
            continue
        owned.setdefault(info.users[0], []).append((tuple(info.shape), info.dtype))
    return {node: tuple(sorted(tensors)) for node, tensors in owned.items()}


def _modelled_step(sizes: Sizes, state: int, model: DeviceModel) -> float:
    """Roofline of an update: weights, gradients and `state` copies read, weights and state
    written; the device model's per-operation overhead once per tensor."""
    total = 0.0
    for shape, dtype in sizes:
        nbytes = _numel(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        total += model.overhead_s + (2 * nbytes + nbytes + 2 * state * nbytes) / (
            model.memory_bandwidth
        )
    return total


def _modelled_accumulate(sizes: Sizes, model: DeviceModel) -> float:
    """Roofline of adding gradients to those held: two read and one written per tensor, and the
    device model's per-operation overhead."""
    total = 0.0
    for shape, dtype in sizes:
        nbytes = _numel(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        total += model.overhead_s + 3 * nbytes / model.memory_bandwidth
    return total


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _timed_steps(
    optimizer: str | OptimizerFactory,
    info: OptimizerInfo,
    sizes: dict[str, Sizes],
    where: tuple[torch.device, int, int, int, int],
    cache: bool | str | Path,
) -> tuple[dict[Sizes, float], dict[Sizes, float], float]:
    """Seconds of one step over each distinct set of tensors, less the fixed cost per call;
    of their gradients' accumulation; and that cost. `where`: device, threads, warmup,
    repeats, other processes training."""
    factory = optimizer_factory(optimizer)
    device, num_threads, warmup, repeats, _ = where
    path = _cache_path(cache, info.key, where)
    cached = _read(path)
    wanted = sorted(set(sizes.values()))
    missing = [s for s in wanted if _key(s) not in cached["steps"]]
    missing += [s for s in wanted if _key(s) not in cached["adds"] and s not in missing]
    if missing or "call_s" not in cached:
        threads = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            if "call_s" not in cached:
                cached["call_s"] = _call_s(factory, device, warmup, repeats)
            for s in missing:
                seconds = _step_time(factory, s, device, warmup, repeats)
                cached["steps"][_key(s)] = max(seconds - cached["call_s"], 0.0)
                cached["adds"][_key(s)] = _accumulate_time(s, device, warmup, repeats)
        finally:
            torch.set_num_threads(threads)
        _write(path, cached)
    steps = {s: cached["steps"][_key(s)] for s in wanted}
    return steps, {s: cached["adds"][_key(s)] for s in wanted}, cached["call_s"]


def _step_time(
    factory: OptimizerFactory, sizes: Sizes, device: torch.device, warmup: int, repeats: int
) -> float:
    """The median seconds of `step()` + `zero_grad(set_to_none=True)` over tensors of `sizes`,
    each repeat after the caches were overwritten (`cache_evictor`)."""
    params = [
        torch.nn.Parameter(torch.randn(shape, device=device).to(getattr(torch, dtype)))
        for shape, dtype in sizes
    ]
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    built = factory(params)
    timer = device_timer(device)
    evict = cache_evictor(device)  # a stage's step finds its weights and state out of cache
    times = []
    for _ in range(warmup + repeats):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        evict()
        times.append(timer(lambda: (built.step(), built.zero_grad(set_to_none=True))))
    return statistics.median(times[warmup:])


def _accumulate_time(sizes: Sizes, device: torch.device, warmup: int, repeats: int) -> float:
    """The median seconds of adding a gradient to the one held, for tensors of `sizes`, warm
    (what `AccumulateGrad` runs when a parameter holds a gradient)."""
    held = [torch.randn(shape, device=device).to(getattr(torch, dtype)) for shape, dtype in sizes]
    fresh = [torch.randn_like(t) for t in held]
    timer = device_timer(device)

    def add() -> None:
        for h, f in zip(held, fresh, strict=True):
            h.add_(f)

    return statistics.median([timer(add) for _ in range(warmup + repeats)][warmup:])


def _call_s(factory: OptimizerFactory, device: torch.device, warmup: int, repeats: int) -> float:
    """The fixed seconds of one `step()` call: the intercept of step times over 1, 2, 4, 8 and
    16 one-element tensors (least squares; at least 0)."""
    counts = [1, 2, 4, 8, 16]
    times = [_step_time(factory, (((1,), "float32"),) * n, device, warmup, repeats) for n in counts]
    mean_n, mean_t = statistics.fmean(counts), statistics.fmean(times)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(counts, times, strict=True)) / sum(
        (n - mean_n) ** 2 for n in counts
    )
    return max(mean_t - slope * mean_n, 0.0)


def _key(sizes: Sizes) -> str:
    return json.dumps([[list(shape), dtype] for shape, dtype in sizes])


def _cache_path(
    cache: bool | str | Path, name: str, where: tuple[torch.device, int, int, int, int]
) -> Path | None:
    if not cache:
        return None
    directory = default_cache_dir() if cache is True else Path(cache)
    device, threads, warmup, repeats, loaded_by = where
    fields = [name, str(device), threads, warmup, repeats, torch.__version__, _CACHE_FORMAT]
    fields += [loaded_by] if loaded_by else []  # timed alone: older versions' file names
    key = hashlib.sha256(json.dumps(fields).encode()).hexdigest()
    return directory / f"optimizer-{key[:24]}.json"


def _read(path: Path | None) -> dict[str, Any]:
    empty: dict[str, Any] = {"steps": {}, "adds": {}}
    if path is None:
        return empty
    try:
        doc = json.loads(read_regular_text(path))
        if doc.get("format") != _CACHE_FORMAT:
            return empty
        steps = {str(k): float(v) for k, v in doc["steps"].items()}
        adds = {str(k): float(v) for k, v in doc["adds"].items()}
        return {"steps": steps, "adds": adds, "call_s": float(doc["call_s"])}
    except FileNotFoundError:
        return empty
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("ignoring optimizer cache %s (%s); timing again", path, e)
        return empty


def _write(path: Path | None, cached: dict[str, Any]) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"format": _CACHE_FORMAT, **cached}))
        tmp.replace(path)
    except OSError as e:
        log.warning("cannot write optimizer cache %s: %s", path, e)


# -- the loss --------------------------------------------------------------------------------


def annotate_loss(
    gm: fx.GraphModule,
    inputs: Mapping[str, torch.Tensor],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    targets: Any,
    timing: StepTiming,
) -> fx.GraphModule:
    """Write `gm.meta["pdcompile.loss_s"]`: the loss function's (forward, backward) seconds on
    the graph's output for the example and `targets` (None without `loss_fn` or `targets`),
    timed or priced on the device model (`timing`; its cache is not used).

    Raises:
        CostError: `loss_fn` fails on the example's output and the targets, or does not give a
            scalar tensor.
    """
    if loss_fn is None or targets is None:
        gm.meta[LOSS_S] = None
        return gm
    device = next(iter(inputs.values())).device
    targets = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, targets)
    args = [inputs[p.target] for p in gm.graph.find_nodes(op="placeholder")]
    with preserved_state(gm), torch.no_grad():
        output = gm(*args)
    leaves = pytree.tree_map(_leaf, output)
    grads_to = [t for _, t in iter_tensors(leaves) if t.requires_grad]
    _check_loss(loss_fn, leaves, targets)
    if timing.profile:
        threads = torch.get_num_threads()
        torch.set_num_threads(timing.num_threads)
        try:
            seconds = _timed_loss(loss_fn, leaves, targets, grads_to, device, timing.warmup,
                                  timing.repeats)  # fmt: skip
        finally:
            torch.set_num_threads(threads)
    else:
        seconds = _modelled_loss(loss_fn, leaves, targets, grads_to, timing.device_model)
    gm.meta[LOSS_S] = seconds
    return gm


def _leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
        return value.detach().requires_grad_(True)
    return value


def _check_loss(loss_fn: Callable[[Any, Any], torch.Tensor], output: Any, targets: Any) -> None:
    try:
        with torch.enable_grad():
            loss = loss_fn(output, targets)
    except Exception as e:
        raise CostError(
            f"loss_fn raised {type(e).__name__} on the example's output and the targets: {e}; "
            "pass targets for the example's rows, as train_step will get them"
        ) from e
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise CostError(
            f"loss_fn returned {type(loss).__name__} "
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; it must return a "
            "scalar tensor"
        )


def _timed_loss(
    loss_fn: Callable[[Any, Any], torch.Tensor],
    output: Any,
    targets: Any,
    grads_to: list[torch.Tensor],
    device: torch.device,
    warmup: int,
    repeats: int,
) -> tuple[float, float]:
    timer = device_timer(device)
    with torch.enable_grad():
        forward = [timer(lambda: loss_fn(output, targets)) for _ in range(warmup + repeats)]
        loss = loss_fn(output, targets)
    backward = [0.0] * (warmup + repeats)
    if loss.requires_grad and grads_to:

        def grad() -> object:
            return torch.autograd.grad(loss, grads_to, retain_graph=True, allow_unused=True)

        backward = [timer(grad) for _ in range(warmup + repeats)]
    overhead = grad_call_overhead(device, timer, warmup + repeats)
    return (
        statistics.median(forward[warmup:]),
        max(statistics.median(backward[warmup:]) - overhead, 0.0) if any(backward) else 0.0,
    )


class _BytesMoved(TorchDispatchMode):
    """Sums the bytes of every ATen operation's tensor arguments and results."""

    def __init__(self) -> None:
        super().__init__()
        self.moved = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for _, t in iter_tensors((args, kwargs or {}, out)):
            self.moved += t.numel() * t.element_size()
        return out


def _modelled_loss(
    loss_fn: Callable[[Any, Any], torch.Tensor],
    output: Any,
    targets: Any,
    grads_to: list[torch.Tensor],
    model: DeviceModel,
) -> tuple[float, float]:
    with torch.enable_grad(), flop_counter() as flops, _BytesMoved() as moved:
        loss = loss_fn(output, targets)
    forward = model.time(float(flops.get_total_flops()), float(moved.moved))
    if not (loss.requires_grad and grads_to):
        return forward, 0.0
    with flop_counter() as flops, _BytesMoved() as moved:
        torch.autograd.grad(loss, grads_to, allow_unused=True)
    return forward, model.time(float(flops.get_total_flops()), float(moved.moved))
