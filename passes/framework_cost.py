"""The per-operation cost of the framework, calibrated once per machine: `calibrate()`.

Every ATen operation a training step runs pays a fixed cost besides its arithmetic: the
dispatcher, autograd's bookkeeping (recording a backward node), allocating its output, and on
CUDA a kernel launch. The backward pays the autograd engine per node it runs, and each node pays
again for the operations it runs (a Linear's `AddmmBackward0` runs about ten: two `mm`, a `sum`,
transposes, views; a ReLU's one). On a small operation that fixed cost is most of its time
(several microseconds each on a CPU core).

`calibrate` measures it in real training steps of chains of N tiny operations on 16 floats, for
several N: *mixed* chains (a multiply, an add, a ReLU and a view, in turn) and *pass-through*
chains (adds of a constant, whose backward nodes run no operation). The operations forward, the
autograd nodes backward and the operations they run are counted exactly as `framework_fold`
counts a graph's nodes, and slopes of time against count (Theil-Sen: the median of the pairwise
slopes between the chain lengths, each length's time a median over the repeats) give the cost
of one more operation forward (`forward_op_s`: the mixed chains), of one more backward node
(`backward_node_s`: the pass-through chains' backward) and of one more operation in a backward
node (`backward_op_s`: the mixed chains' backward less their nodes' cost). Chain lengths and
kinds alternate in order between repeats, so a slow spell of the machine falls on all alike.

A calibration is cached on disk beside the profile cache (`framework-<key>.json`, keyed by host,
torch version, device and thread count) with its provenance; `pdcompile calibrate` measures it
again. This is not `runtime/calibration.py`, which measures a cluster's links for the simulator.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from itertools import combinations
from pathlib import Path
from typing import Any

import torch

from pdcompile.core.errors import CostError
from pdcompile.core.regular_file import read_regular_text
from pdcompile.passes.framework_fold import count_backward, count_forward, count_grad_ops
from pdcompile.passes.profile_cache import default_cache_dir

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # 2: backward_op_s
CHAIN_LENGTHS = (0, 32, 64, 128, 192)  # operations per chain (a length-0 chain fits the intercept)
_WIDTH = 16  # floats per tensor: the arithmetic is negligible next to the fixed cost
# One process measures once per key when the disk cache is off (`cache=False`).
_MEASURED: dict[str, FrameworkCost] = {}


@dataclass(frozen=True)
class Fit:
    """A straight line through (count, seconds) points: Theil-Sen's slope and intercept, and
    `spread`, the relative dispersion of the pairwise slopes ((p75 - p25) / median, 0 when
    fewer than four points)."""

    slope: float
    intercept: float
    spread: float


def fit_slope(counts: Sequence[float], seconds: Sequence[float]) -> Fit:
    """Theil-Sen: the median of the slopes between every pair of points with different counts,
    and the median of `seconds - slope * counts`. A few points disturbed by another process move
    it less than a least-squares fit.

    Raises:
        CostError: fewer than two distinct counts, or lengths that differ.

    Example (one point far off the line, which least squares would follow to a slope of 0.4):
        >>> fit = fit_slope([0, 10, 20, 30, 40], [1.0, 2.0, 3.0, 4.0, 20.0])
        >>> fit.slope, fit.intercept, round(fit.spread, 2)
        (0.1, 1.0, 4.69)
    """
    if len(counts) != len(seconds):
        raise CostError(f"fit_slope: {len(counts)} counts but {len(seconds)} times")
    slopes = [
        (seconds[j] - seconds[i]) / (counts[j] - counts[i])
        for i, j in combinations(range(len(counts)), 2)
        if counts[j] != counts[i]
    ]
    if not slopes:
        raise CostError(f"fit_slope needs two distinct counts, got {list(counts)}")
    slope = statistics.median(slopes)
    intercept = statistics.median(t - slope * c for c, t in zip(counts, seconds, strict=True))
    spread = 0.0
    if len(slopes) >= 4 and slope > 0:
        q1, _, q3 = statistics.quantiles(slopes, n=4, method="inclusive")
        spread = (q3 - q1) / slope
    return Fit(slope, intercept, spread)


@dataclass(frozen=True)
class FrameworkCost:
    """Seconds a training step pays per operation besides its arithmetic, on one machine.

    Attributes:
        forward_op_s: per ATen operation run forward with autograd on (dispatch, recording the
            backward node, allocating the output; on CUDA, the kernel launch).
        backward_node_s: per autograd node the backward runs (the engine's scheduling and
            bookkeeping; an `AccumulateGrad` too).
        backward_op_s: per ATen operation those nodes run (dispatch, allocation, launch).
        spread: (forward, backward node, backward op) relative dispersion of the fits' pairwise
            slopes.
        device, num_threads, torch_version, host, measured_at: what was measured, where, when
            (UTC, ISO 8601); the first four key the cache.
        chain_lengths, repeats: how.
        cached, cache_path: read from (or written to) this file; None when not cached.
    """

    forward_op_s: float
    backward_node_s: float
    backward_op_s: float
    spread: tuple[float, float, float]
    device: str
    num_threads: int
    torch_version: str
    host: str
    measured_at: str
    chain_lengths: tuple[int, ...] = CHAIN_LENGTHS
    repeats: int = 0
    cached: bool = False
    cache_path: str | None = None

    def __post_init__(self) -> None:
        costs = (self.forward_op_s, self.backward_node_s, self.backward_op_s)
        if not all(c >= 0 for c in costs):
            raise CostError(
                f"FrameworkCost needs forward_op_s, backward_node_s and backward_op_s >= 0, got "
                f"{', '.join(map(str, costs))}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (what a CostGraph's `meta["framework"]` records)."""
        fields = asdict(self)
        return {**fields, "spread": list(self.spread), "chain_lengths": list(self.chain_lengths)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FrameworkCost:
        """The inverse of `to_dict` (unknown keys refused by the constructor)."""
        fields = dict(data)
        fields["spread"] = tuple(float(s) for s in fields["spread"])
        fields["chain_lengths"] = tuple(int(n) for n in fields.get("chain_lengths", CHAIN_LENGTHS))
        return cls(**fields)

    def origin(self) -> str:
        """'framework cost 3.1 us per op forward, 2.2 us per node + 1.4 us per op backward (cpu, 1
        thread, torch 2.13.0, host h, measured 2025-01-01T10:00:00+00:00), cached in ...'"""
        threads = f"{self.num_threads} thread{'s' if self.num_threads != 1 else ''}"
        where = f"cached in {self.cache_path}" if self.cache_path else "not cached"
        return (
            f"framework cost {self.forward_op_s * 1e6:.3g} us per op forward, "
            f"{self.backward_node_s * 1e6:.3g} us per node + {self.backward_op_s * 1e6:.3g} us per "
            f"op backward ({self.device}, {threads}, "
            f"torch {self.torch_version}, host {self.host}, measured {self.measured_at}), {where}"
        )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def cache_key(device: torch.device, num_threads: int) -> str:
    fields = [CACHE_FORMAT, platform.node(), torch.__version__, _device_name(device), num_threads]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


def cache_file(cache: bool | str | Path, key: str) -> Path | None:
    """Beside the profile cache (`cache=True`), in the directory `cache`, or None (False)."""
    if not cache:
        return None
    directory = default_cache_dir() if cache is True else Path(cache)
    return directory / f"framework-{key[:24]}.json"


def read_cached(
    device: str | torch.device = "cpu", num_threads: int = 1, cache: bool | str | Path = True
) -> FrameworkCost | None:
    """The calibration cached for this host, torch, device and thread count, or None."""
    key = cache_key(torch.device(device), num_threads)
    if not cache:
        return _MEASURED.get(key)
    path = cache_file(cache, key)
    try:
        doc = json.loads(read_regular_text(path))
        if doc.get("format") != CACHE_FORMAT or doc.get("key") != key:
            return None
        found = FrameworkCost.from_dict(doc["calibration"])
        return replace(found, cached=True, cache_path=str(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable framework-cost cache %s (%s); calibrating again", path, e)
        return None


def calibrate(
    device: str | torch.device | None = None,
    *,
    num_threads: int = 1,
    repeats: int = 30,
    warmup: int = 5,
    cache: bool | str | Path = True,
    refresh: bool = False,
) -> FrameworkCost:
    """The per-operation framework cost on this machine: cached, or measured (about a second).

    Args:
        device: where (default: the CPU).
        num_threads: CPU threads while measuring: the profile's (restored afterwards).
        repeats, warmup: timed and untimed runs of every chain.
        cache: True (the profile cache's directory), a directory, or False (measured once per
            process, nothing read from or written to disk).
        refresh: measure again even when cached (and overwrite the file).

    Returns:
        The FrameworkCost; `.origin()` says what, where and when.

    Example:
        >>> cost = pdcompile.calibrate()
        >>> cost.forward_op_s, cost.backward_node_s, cost.backward_op_s
        (3.1e-06, 2.2e-06, 1.4e-06)
    """
    device = torch.device(device or "cpu")
    key = cache_key(device, num_threads)
    if not refresh:
        found = read_cached(device, num_threads, cache)
        if found is not None:
            return found
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        forward, node, op = _measure(device, repeats, warmup)
    finally:
        torch.set_num_threads(threads)
    cost = FrameworkCost(
        forward_op_s=max(forward.slope, 0.0),
        backward_node_s=max(node.slope, 0.0),
        backward_op_s=max(op.slope, 0.0),
        spread=tuple(round(f.spread, 4) for f in (forward, node, op)),
        device=_device_name(device),
        num_threads=num_threads,
        torch_version=torch.__version__,
        host=platform.node(),
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        repeats=repeats,
    )
    _MEASURED[key] = cost
    path = cache_file(cache, key)
    if path is not None:
        cost = replace(cost, cache_path=str(path))
        doc = {"format": CACHE_FORMAT, "key": key, "calibration": cost.to_dict()}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
    log.info("%s", cost.origin())
    return cost


def framework_cost(
    calibration: bool | FrameworkCost,
    device: torch.device,
    num_threads: int,
    cache: bool | str | Path,
    *,
    measure: bool,
) -> FrameworkCost | None:
    """What `analyze(..., calibration=)` folds in: None for False, the object given, or for True
    the calibration cached for `device` and `num_threads`, measured when none is and `measure`
    (profiling). Nothing on the meta device, which has no time to measure.

    Raises:
        CostError: `calibration` is neither a bool nor a FrameworkCost.
    """
    if isinstance(calibration, FrameworkCost):
        return calibration
    if not isinstance(calibration, bool):
        raise CostError(
            f"calibration must be True, False or a FrameworkCost (pdcompile.calibrate()), got "
            f"{calibration!r}"
        )
    if not calibration or device.type == "meta":
        return None
    if measure:
        return calibrate(device, num_threads=num_threads, cache=cache)
    found = read_cached(device, num_threads, cache)
    if found is None:
        log.info(
            "no framework cost calibrated for %s at %d threads: analytic times keep the device "
            "model's overhead (run `pdcompile calibrate` to fold one in)", device, num_threads,
        )  # fmt: skip
    return found


_MIXED: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = (
    lambda y: y * 1.0001,
    lambda y: y + 0.5,
    torch.relu,
    lambda y: y.view(-1),
)
_PASS = (lambda y: y + 0.5,)  # AddBackward0 hands the gradient on: a node running nothing
CHAINS = {"mixed": _MIXED, "pass": _PASS}


def _chain(x: torch.Tensor, kind: str, length: int) -> torch.Tensor:
    steps, y = CHAINS[kind], x
    for i in range(length):
        y = steps[i % len(steps)](y)
    return y


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Wall clock; on CUDA, synchronized before and after (launches are what is measured)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn: Callable[[], object]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    return timed


def _measure(device: torch.device, repeats: int, warmup: int) -> tuple[Fit, Fit, Fit]:
    """Time every chain forward and backward, alternating their order; fit the three slopes:
    forward per operation (mixed chains), backward per node (pass-through chains), backward per
    operation (mixed chains, their nodes' cost taken off)."""
    x = torch.rand(_WIDTH, device=device).add_(0.5).requires_grad_()
    chains = [(kind, n) for kind in CHAINS for n in CHAIN_LENGTHS]
    counts = {chain: _counts(x, *chain) for chain in chains}
    timer = _timer(device)
    times: dict[tuple[str, int], tuple[list[float], list[float]]] = {c: ([], []) for c in chains}
    for r in range(warmup + repeats):
        for chain in chains if r % 2 == 0 else reversed(chains):
            out: list[torch.Tensor] = []
            with torch.enable_grad():
                forward = timer(lambda chain=chain, out=out: out.append(_chain(x, *chain).sum()))
            backward = timer(out[0].backward)
            x.grad = None
            if r >= warmup:
                times[chain][0].append(forward)
                times[chain][1].append(backward)
    median = {c: (statistics.median(t[0]), statistics.median(t[1])) for c, t in times.items()}
    mixed = [c for c in chains if c[0] == "mixed"]
    passing = [c for c in chains if c[0] == "pass"]
    forward = fit_slope([counts[c][0] for c in mixed], [median[c][0] for c in mixed])
    node = fit_slope([counts[c][1] for c in passing], [median[c][1] for c in passing])
    op = fit_slope(
        [counts[c][2] for c in mixed],
        [median[c][1] - max(node.slope, 0.0) * counts[c][1] for c in mixed],
    )
    return forward, node, op


def _counts(x: torch.Tensor, kind: str, length: int) -> tuple[int, int, int]:
    """(ATen operations forward, autograd nodes backward, ATen operations they run) of one chain
    and its sum, counted as the fold counts a graph's nodes (the leaf's `AccumulateGrad`: one
    node, one operation)."""
    with torch.enable_grad():
        forward, (out,) = count_forward(lambda: (_chain(x, kind, length).sum(),))
    nodes = count_backward([out], stop=(), activations={id(x)}, weights=set())[0]
    return forward, nodes + 1, count_grad_ops([out], [x]) + 1
