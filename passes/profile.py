"""Profiling: measured forward and backward time of every node, medians over repeats.

Every compute node runs alone on the values a full forward pass produced: its forward (autograd
on, as in training) is timed `warmup + repeats` times, then its backward (`torch.autograd.grad`
from its outputs to its inputs and parameters, graph retained) likewise, and the medians of the
repeats are kept. A node with both activation inputs and weights (`node_runner.split_inputs`)
also has the two parts of a split backward timed alone: the input gradients only (I) and the
weight gradients only (W); a node with one kind has its whole backward in that part. On CPU the
wall clock times it at a fixed thread count (one by default); on CUDA, CUDA events do.
Placeholders, parameters (`get_attr`) and the output cost nothing.

A time whose median is far above its fastest repeat (another process took the device during
part of the repeats), or whose repeats spread widely ((p75 - p25) / median above `MAX_SPREAD`),
is measured again, at most `EXTRA_ROUNDS` times; a profile still unsettled after that is used
but flagged (`UnsettledProfileWarning`, `ProfileSettings.unsettled`) and not cached; times still
spread are used, cached and listed (`ProfileSettings.noisy`, with their rounds). A profile taken
while other processes train on purpose (`loaded_by`, `compile`'s ranks) is judged by its spread
only: its slow repeats are the load it measures.

Settled profiles are cached (`profile_cache`), so a second run on the same model is instant; a
profile served from the cache says so (file and age: `ProfileSettings.origin()`, a log record,
and a console line when `progress` is on).

Reads `pdcompile.outputs`. Writes `pdcompile.measured_s` (`(forward, backward)` seconds),
`pdcompile.measured_split_s` (`(backward_input, backward_weight)` seconds) and
`pdcompile.measured_spread` (`(forward, backward)` spreads of the repeats) on every node and
`gm.meta["pdcompile.profile"]` (the `ProfileSettings`).
"""

from __future__ import annotations

import logging
import math
import statistics
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.fx as fx
from rich.console import Console

from pdcompile.core.errors import UnsettledProfileWarning
from pdcompile.core.ir import MEASURED_S, MEASURED_SPLIT_S, MEASURED_SPREAD, PROFILE
from pdcompile.core.progress import phase
from pdcompile.graph.node_runner import (
    COMPUTE_OPS,
    NodeCall,
    differentiable_outputs,
    invoke,
    record_values,
    weight_nodes,
)
from pdcompile.graph.state import preserved_state
from pdcompile.passes.profile_cache import (
    CachedProfile,
    ProfileSettings,
    cache_file,
    cache_key,
    read_cache,
    write_cache,
)
from pdcompile.passes.timing import device_timer, grad_call_overhead

log = logging.getLogger(__name__)

# A time is unsettled when the median of its repeats exceeds this multiple of the fastest one.
# Interference only ever adds time, so the fastest repeat is the best view of the work alone, and
# median/fastest bounds how far interference may have moved the median that is used: one
# preempted repeat leaves it near 1 (the median ignores it), a majority of slowed repeats does
# not (an LSTM backward cached at 58.9 ms took 1.3 ms when measured again). At 1.5, on 2 cores
# run at twice to thrice their capacity, most first rounds of the zoo's gpt, resnet and
# transformer had unsettled times, and the extra rounds settled most of those profiles.
MAX_SLOWDOWN = 1.5
# ...and when the time interference may have added (median minus fastest) is at least this share
# of the profile's total: below it, scheduler and clock jitter of tiny nodes cannot move a plan.
MIN_SHARE = 0.01
# A time is noisy when the middle half of its repeats spans more than this share of their median
# ((p75 - p25) / median), and that span is at least `MIN_SHARE` of the total. For roughly normal
# repeats the interquartile range is 1.35 standard deviations and the median of n repeats has a
# standard error of 1.25 sd / sqrt(n): at 0.5 and the default 10 repeats the median is uncertain
# by about 15% of itself, the fidelity the cost model aims at. Noisy times are measured again
# like unsettled ones; those still noisy are used and listed, not warned about (the median is
# robust to a scattered minority; a slowed majority is what `MAX_SLOWDOWN` catches).
MAX_SPREAD = 0.5
# Measuring rounds after the first, for the unsettled and noisy times only (fresh repeats replace
# theirs).
# Bounded: a machine that stays loaded does not settle; its user is better told than kept waiting.
EXTRA_ROUNDS = 2
_WHOLE = "(whole graph)"  # in `slowdown`: the forward and backward of the whole graph per run
# What a node's times (and slowdowns) are, in order; `_WHOLE` has the first two.
DIRECTIONS = ("forward", "backward", "backward_input", "backward_weight")


@dataclass
class _Alone:
    """A node's backward timed alone: the fixed cost of a grad call, the repeats of the whole
    backward, and for a node with both kinds those of its input-gradient part I and its
    weight-gradient part W (else None: `kind` says which part the whole is)."""

    overhead: float
    whole: list[float]
    kind: str  # "both", "input" or "weight"
    input: list[float] | None = None
    weight: list[float] | None = None


@dataclass
class _Samples:
    """Timed repeats in seconds."""

    forward: dict[str, list[float]]  # node -> its forward in context
    backward: dict[str, _Alone]  # node -> its backward alone
    whole: tuple[list[float], list[float]]  # the graph's forward (node sum), backward, in context


@dataclass(frozen=True)
class _Profile:
    """What the samples say: the times used, how far each median is above its fastest, how
    widely the repeats spread, and in how many rounds each was measured."""

    times: dict[str, list[float]]  # node -> seconds, in the order of `DIRECTIONS`
    slowdown: dict[str, list[float]]  # node or _WHOLE -> median / fastest, same order
    spread: dict[str, list[float]] = field(default_factory=dict)  # (p75 - p25) / median
    rounds: dict[str, list[int]] = field(default_factory=dict)  # measuring rounds, same order
    whole: tuple[float, float] = (0.0, 0.0)  # the graph's forward and backward, medians
    scale: float = 1.0  # in-context whole backward / sum of the isolated ones

    def noisy(self) -> list[tuple[str, str, float]]:
        """`(node, direction, spread)` of the times spread above `MAX_SPREAD` whose span
        (median times spread) is at least `MIN_SHARE` of the total, the largest span first."""
        found = []
        total = math.fsum(t[0] + t[1] for t in self.times.values())
        for name, spreads in self.spread.items():
            for direction, median, s in zip(DIRECTIONS, self._medians(name), spreads, strict=False):
                if s > MAX_SPREAD and median > 0 and median * s >= MIN_SHARE * total:
                    found.append((median * s, name, direction, round(s, 4)))
        return [(name, direction, s) for _, name, direction, s in sorted(found, reverse=True)]

    def noisy_report(self) -> tuple[tuple[str, str, float, float, int], ...]:
        """`ProfileSettings.noisy`: the noisy times with their medians and rounds."""
        return tuple(
            (name, d, self._medians(name)[DIRECTIONS.index(d)], s,
             self.rounds.get(name, [1] * 4)[DIRECTIONS.index(d)])
            for name, d, s in self.noisy()
        )  # fmt: skip

    def cached(self, measured_at: str) -> CachedProfile:
        return CachedProfile(
            self.times, self.slowdown, self.spread, self.rounds, measured_at, self.whole, self.scale
        )

    def unsettled(self) -> list[tuple[str, str, float]]:
        """`(node, direction, slowdown)` of the times above `MAX_SLOWDOWN` by more than
        `MIN_SHARE` of the total, the largest error first."""
        found = []
        total = math.fsum(t[0] + t[1] for t in self.times.values())
        for name, slowdowns in self.slowdown.items():
            medians = self._medians(name)  # as many as `slowdowns` (2 for _WHOLE)
            for direction, median, s in zip(DIRECTIONS, medians, slowdowns, strict=False):
                if s > MAX_SLOWDOWN and median * (1 - 1 / s) >= MIN_SHARE * total:
                    found.append((median * (1 - 1 / s), name, direction, round(s, 2)))
        return [(name, direction, s) for _, name, direction, s in sorted(found, reverse=True)]

    def describe(self, unsettled: list[tuple[str, str, float]]) -> str:
        """'lstm backward (58.9 ms median, 45.3x its fastest repeat), ...', the first five."""
        parts = []
        for name, direction, s in unsettled[:5]:
            what = f"the whole {direction}" if name == _WHOLE else f"{name} {direction}"
            median = self._medians(name)[DIRECTIONS.index(direction)]
            parts.append(f"{what} ({median * 1e3:.3g} ms median, {s:.1f}x its fastest repeat)")
        more = f" and {len(unsettled) - 5} more" if len(unsettled) > 5 else ""
        return ", ".join(parts) + more

    def _medians(self, name: str) -> list[float]:
        if name != _WHOLE:
            return self.times[name]
        return [math.fsum(pair[i] for pair in self.times.values()) for i in (0, 1)]


def _slowdown(times: list[float]) -> float:
    """Median over fastest repeat; 1 where that says nothing (one repeat, no time)."""
    fastest = min(times, default=0.0)
    return statistics.median(times) / fastest if len(times) > 1 and fastest > 0 else 1.0


def _spread(times: list[float]) -> float:
    """(p75 - p25) / median of the repeats; 0 where that says nothing (one repeat, no time)."""
    if len(times) < 2:
        return 0.0
    median = statistics.median(times)
    if median <= 0:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / median


def _summarize(samples: _Samples, rounds: dict[str, list[int]] | None = None) -> _Profile:
    def alone(b: _Alone, repeats: list[float] | None) -> float:
        return max(statistics.median(repeats) - b.overhead, 0.0) if repeats else 0.0

    # The whole backward, measured in context, is shared out in proportion to the isolated runs;
    # the parts of a split backward, timed alone too, are scaled alike (they need not add up to
    # the whole: the two calls may each do work the fused one shares).
    total = math.fsum(alone(b, b.whole) for b in samples.backward.values())
    scale = statistics.median(samples.whole[1]) / (total or 1.0)
    times, slowdown, spread = {}, {}, {}
    for n, forward in samples.forward.items():
        times[n] = [statistics.median(forward), 0.0, 0.0, 0.0]
        slowdown[n] = [_slowdown(forward), 1.0, 1.0, 1.0]
        spread[n] = [_spread(forward), 0.0, 0.0, 0.0]
        b = samples.backward.get(n)
        if b is None:
            continue
        parts = (b.input, b.weight) if b.kind == "both" else (None, None)
        times[n][1:] = [alone(b, b.whole) * scale, *(alone(b, p) * scale for p in parts)]
        slowdown[n][1:] = [_slowdown(b.whole), *(_slowdown(p or []) for p in parts)]
        spread[n][1:] = [_spread(b.whole), *(_spread(p or []) for p in parts)]
        if b.kind != "both":  # the whole backward is the one part the node has
            part = 2 if b.kind == "input" else 3
            times[n][part], spread[n][part] = times[n][1], spread[n][1]
    slowdown[_WHOLE] = [_slowdown(samples.whole[0]), _slowdown(samples.whole[1])]
    spread[_WHOLE] = [_spread(samples.whole[0]), _spread(samples.whole[1])]
    rounds = rounds or {}
    rounds = {n: list(rounds.get(n, [1] * len(spread[n]))) for n in spread}
    whole = (statistics.median(samples.whole[0]), statistics.median(samples.whole[1]))
    return _Profile(times, slowdown, spread, rounds, whole, scale)


def _settled(times: dict[str, list[float]], slowdown: dict[str, list[float]]) -> bool:
    """Whether cached times pass today's thresholds."""
    return not _Profile(times, slowdown).unsettled()


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
    gm: fx.GraphModule,
    values: dict,
    node: fx.Node,
    timer: Callable,
    warmup: int,
    repeats: int,
    weights: frozenset[str],
    overhead: float,
) -> _Alone | None:
    """The timed repeats of the node's backward alone, and of each part of a split backward
    when the node has both kinds of gradient; None when it has no backward."""
    call = NodeCall(gm, node, values, weights)
    args, kwargs, activations, params = call.split_inputs()
    with torch.enable_grad():
        outputs = differentiable_outputs(call.forward(args, kwargs))
    if not (outputs and (activations or params)):
        return None
    grads = [torch.ones_like(t) for t in outputs]

    def timed(targets: list[torch.Tensor]) -> list[float]:
        def grad() -> object:
            return torch.autograd.grad(
                outputs, targets, grads, retain_graph=True, allow_unused=True
            )

        return [timer(grad) for _ in range(warmup + repeats)][warmup:]

    whole = timed(activations + params)
    if not (activations and params):
        return _Alone(overhead, whole, "input" if activations else "weight")
    return _Alone(overhead, whole, "both", timed(activations), timed(params))


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
    backward_nodes: list[str] | None = None,
) -> _Samples:
    """One measuring round: the whole graph `warmup + repeats` times, then every node's backward
    alone (only those of `backward_nodes`, when given)."""
    timer = device_timer(device)
    args = [inputs[p.target] for p in gm.graph.find_nodes(op="placeholder")]
    nodes = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    alone = [n for n in nodes if backward_nodes is None or n.name in backward_nodes]
    samples = _Samples({n.name: [] for n in nodes}, {}, ([], []))
    params = [p for p in gm.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    for p in params:  # autograd would accumulate into the user's gradients in place
        p.grad = None
    what = f"profiling {len(nodes)} nodes" if backward_nodes is None else "profiling again"
    total = warmup + repeats + len(alone)  # whole passes, then backwards alone
    with phase(what, total=total, enabled=progress) as bar, preserved_state(gm):
        for i in range(warmup + repeats):
            interpreter = _TimedInterpreter(gm, timer)
            with torch.enable_grad():
                outputs = differentiable_outputs(interpreter.run(*args))
            backward_s = _backward_time(timer, outputs)
            for p in params:
                p.grad = None
            if i >= warmup:
                samples.whole[0].append(math.fsum(interpreter.times.values()))
                samples.whole[1].append(backward_s)
                for name, seconds in interpreter.times.items():
                    samples.forward[name].append(seconds)
            bar.advance()
        values = record_values(gm, inputs)
        overhead = grad_call_overhead(device, timer, warmup + repeats)
        weights = weight_nodes(gm)
        for node in alone:
            timed = _isolated_backward(gm, values, node, timer, warmup, repeats, weights, overhead)
            if timed is not None:
                samples.backward[node.name] = timed
            bar.advance()
    for p, grad in zip(params, saved_grads, strict=True):
        p.grad = grad
    return samples


def _measure_settled(
    gm: fx.GraphModule,
    inputs: Mapping[str, torch.Tensor],
    device: torch.device,
    warmup: int,
    repeats: int,
    progress: bool,
    loaded: bool,
) -> tuple[_Profile, list[tuple[str, str, float]]]:
    """Measure, then measure the unsettled and noisy times again (their fresh repeats replace the
    old), at most `EXTRA_ROUNDS` times. Returns the profile and its times still unsettled (none
    when `loaded`: other processes trained meanwhile on purpose, so a median above the fastest
    repeat is the load it measures, not a disturbance)."""
    samples = _measure(gm, inputs, device, warmup, repeats, progress)
    profile = _summarize(samples)
    rounds = profile.rounds
    for extra in range(1, EXTRA_ROUNDS + 1):
        unsettled, noisy = [] if loaded else profile.unsettled(), profile.noisy()
        if not (unsettled or noisy):
            break
        said = [f"{profile.describe(unsettled)} unsettled"] if unsettled else []
        said += [f"{len(noisy)} times noisy (spread above {MAX_SPREAD})"] if noisy else []
        log.info("profile: %s; measuring again (round %d of %d)",
                 "; ".join(said), extra + 1, EXTRA_ROUNDS + 1)  # fmt: skip
        # (name, "forward" or "backward"): a backward and its parts are measured again together
        chosen = {(n, "forward" if d == "forward" else "backward") for n, d, _ in unsettled + noisy}
        if (_WHOLE, "forward") in chosen:  # every forward is measured again with the whole's
            chosen = {(n, d) for n, d in chosen if n == _WHOLE or d != "forward"}
        again = [name for name, direction in chosen if direction == "backward"]
        fresh = _measure(gm, inputs, device, warmup, repeats, progress, again)
        for name, direction in chosen:
            if name == _WHOLE and direction == "forward":
                samples.forward, samples.whole[0][:] = fresh.forward, fresh.whole[0]
                for r in rounds.values():
                    r[0] += 1
            elif name == _WHOLE:
                samples.whole[1][:] = fresh.whole[1]
                rounds[_WHOLE][1] += 1
            elif direction == "forward":
                samples.forward[name] = fresh.forward[name]
                rounds[name][0] += 1
            else:
                samples.backward[name] = fresh.backward[name]
                rounds[name][1:] = [r + 1 for r in rounds[name][1:]]
        profile = _summarize(samples, rounds)
    return profile, [] if loaded else profile.unsettled()


def _tell(message: str, progress: bool) -> None:
    """A line people see: a log record, and a console line when progress is shown."""
    log.info(message)
    if progress:
        Console(stderr=True).print(message, markup=False, highlight=False, soft_wrap=True)


def annotate_profile(
    gm: fx.GraphModule,
    inputs: Mapping[str, torch.Tensor],
    *,
    num_threads: int = 1,
    warmup: int = 3,
    repeats: int = 10,
    cache: bool | str | Path = True,
    progress: bool = True,
    loaded_by: int = 0,
) -> fx.GraphModule:
    """Measure every node's forward and backward time on the device of `inputs`.

    Args:
        gm: a captured graph whose parameters live on the same device as `inputs`.
        inputs: the graph's tensor inputs by name.
        num_threads: CPU threads during profiling (restored afterwards).
        warmup, repeats: untimed and timed runs of each forward and backward.
        cache: True for the default cache directory, a directory, or False for no cache.
        progress: show progress (`pdcompile.core.progress`: a bar on a terminal, lines in a log),
            and a line saying so when the times come from the cache.
        loaded_by: other processes training on this machine meanwhile (keys the cache; a
            loaded profile is not judged unsettled: its slow repeats are the load).

    Returns:
        `gm`, annotated; `gm.meta["pdcompile.profile"].origin()` says where the times came from.

    Warns:
        UnsettledProfileWarning: times still unsettled after `EXTRA_ROUNDS` more rounds; they
            are used, and not cached.

    Example:
        >>> annotate_profile(gm, inputs).meta["pdcompile.profile"].origin()
        'profile measured in this run, cached in /home/me/.cache/pdcompile/profile-3f2a.json'
        >>> annotate_profile(gm, inputs).meta["pdcompile.profile"].origin()
        'profile from cache /home/me/.cache/pdcompile/profile-3f2a.json, measured 4 s ago'
    """
    device = next(iter(inputs.values())).device
    settings = ProfileSettings(
        str(device), num_threads, warmup, repeats, torch.__version__, loaded_by
    )
    key = cache_key(gm, inputs, settings)
    path = cache_file(cache, key)
    found = read_cache(path, key, _settled if not loaded_by else lambda *_: True) if path else None
    if found is not None:
        profile = _Profile(found.times, found.slowdown, found.spread, found.rounds,
                           found.whole_s, found.backward_scale)  # fmt: skip
        settings = replace(settings, cached=True, cache_path=str(path),
                           measured_at=found.measured_at)  # fmt: skip
        _tell(f"{settings.origin()} (cache=False or --no-cache measures again)", progress)
    else:
        profile, settings = _measured(gm, inputs, settings, progress)
        if path and not settings.unsettled:
            settings = replace(settings, cache_path=str(path))
            write_cache(path, key, settings, profile.cached(settings.measured_at))
    settings = replace(settings, whole_s=profile.whole, backward_scale=profile.scale,
                       noisy=profile.noisy_report())  # fmt: skip
    for node in gm.graph.nodes:
        measured = profile.times.get(node.name, (0.0,) * len(DIRECTIONS))
        node.meta[MEASURED_S] = tuple(measured[:2])
        node.meta[MEASURED_SPLIT_S] = tuple(measured[2:])
        node.meta[MEASURED_SPREAD] = tuple(profile.spread.get(node.name, (0.0, 0.0))[:2])
    gm.meta[PROFILE] = settings
    return gm


def _measured(
    gm: fx.GraphModule,
    inputs: Mapping[str, torch.Tensor],
    settings: ProfileSettings,
    progress: bool,
) -> tuple[_Profile, ProfileSettings]:
    """The profile measured now under `settings` (its threads, repeats and load), and the
    settings with the time and the unsettled nodes; warns when some stayed unsettled."""
    device = next(iter(inputs.values())).device
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.num_threads)
    try:
        profile, unsettled = _measure_settled(
            gm, inputs, device, settings.warmup, settings.repeats, progress,
            loaded=settings.loaded_by > 0,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    if unsettled:
        warnings.warn(
            f"profile unsettled after {EXTRA_ROUNDS + 1} rounds of {settings.repeats} repeats: "
            f"{profile.describe(unsettled)} (allowed: {MAX_SLOWDOWN}x); another process "
            f"was probably using the {device.type}. These times are used but not cached: "
            "profile on an idle machine (the next run measures again), or raise repeats",
            UnsettledProfileWarning,
            stacklevel=3,
        )
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return profile, replace(settings, measured_at=now, unsettled=tuple(unsettled))
