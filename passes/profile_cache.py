"""The profile cache: measured times kept between runs, and where a profile's times came from.

A settled profile is written to `profile-<key>.json` in `$PDCOMPILE_CACHE_DIR` (default
`~/.cache/pdcompile`). The key hashes what decides the measurement (the graph's code, modules and
output shapes, the input shapes, train/eval mode and the measuring fields of `ProfileSettings`),
never the provenance. `ProfileSettings` holds both, and `.origin()` says in one line where the
times came from and how old they are. Whether cached times are still settled is the measuring
pass's judgement (`read_cache`'s `settled`). The file format is in docs/costs.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.fx as fx

from pdcompile.core.ir import OUTPUTS
from pdcompile.core.regular_file import read_regular_text

log = logging.getLogger(__name__)

# Cache files carry this; files of another (older pdcompile: 3 had no spreads, 2 no split
# backward, files without one no record that their repeats agreed) are measured again and
# overwritten.
CACHE_FORMAT = 4
TIMES_PER_NODE = 4  # forward, backward, and the split backward's input and weight parts
_KEYED = ("device", "num_threads", "warmup", "repeats", "torch_version", "loaded_by")

# node -> [forward, backward, backward_input, backward_weight] (seconds, median / fastest,
# spread or rounds)
Times = dict[str, list[float]]


@dataclass(frozen=True)
class CachedProfile:
    """What a cache file holds: per node its times, each time's median / fastest repeat, spread
    ((p75 - p25) / median) and measuring rounds (the graph's own under `"(whole graph)"` in the
    last three), when it was measured, the whole graph's forward and backward medians and the
    backward's in-context scale (`ProfileSettings.whole_s`, `.backward_scale`)."""

    times: Times
    slowdown: Times
    spread: Times
    rounds: Times
    measured_at: str
    whole_s: tuple[float, float]
    backward_scale: float


@dataclass(frozen=True)
class ProfileSettings:
    """How a profile was measured (the fields up to `loaded_by` key the cache) and where it
    came from.

    Attributes:
        loaded_by: how many other processes on the machine trained the model while it was
            measured (`compile`'s ranks: the run's conditions, `runtime/profile_load.py`).
        cached: read from the cache file `cache_path` rather than measured in this run.
        cache_path: the cache file read or written; None when none was.
        measured_at: when the times were measured, ISO 8601 in UTC.
        unsettled: `(node, direction, median over fastest repeat)` (direction: "forward",
            "backward", "backward_input" or "backward_weight") of the times
            still above `MAX_SLOWDOWN` after the extra rounds; such a profile is not cached.
        whole_s: the whole graph's forward (sum of its nodes') and backward seconds per run,
            medians, in context: the node times' totals.
        backward_scale: the factor that took the nodes' backwards timed alone (less the grad
            call) to their share of the whole backward (`framework_fold` carves with it).
        noisy: `(node, direction, median seconds, spread, rounds)` of the times whose repeats
            still spread above `MAX_SPREAD` ((p75 - p25) / median) after their rounds, the
            largest first; used, cached, and listed by `pdcompile profile`.
    """

    device: str
    num_threads: int
    warmup: int
    repeats: int
    torch_version: str
    loaded_by: int = 0
    cached: bool = False
    cache_path: str | None = None
    measured_at: str | None = None
    unsettled: tuple[tuple[str, str, float], ...] = ()
    whole_s: tuple[float, float] = (0.0, 0.0)
    backward_scale: float = 1.0
    noisy: tuple[tuple[str, str, float, float, int], ...] = ()

    def origin(self, now: datetime | None = None) -> str:
        """One line for people: where the times came from and how old they are.

        Example:
            >>> gm.meta["pdcompile.profile"].origin()
            'profile from cache /home/me/.cache/pdcompile/profile-3f2a.json, measured 3 h ago'
        """
        loaded = f" while {self.loaded_by} other ranks trained" if self.loaded_by else ""
        if self.cached:
            age = _age(self.measured_at, now)
            return f"profile from cache {self.cache_path}, measured {age}{loaded}"
        if self.unsettled:
            return (
                f"profile measured in this run{loaded}, {len(self.unsettled)} times unsettled, "
                "not cached"
            )
        where = f"cached in {self.cache_path}" if self.cache_path else "not cached"
        return f"profile measured in this run{loaded}, {where}"


def _age(measured_at: str | None, now: datetime | None) -> str:
    """'3 h ago' (a time without a zone is taken as UTC)."""
    if measured_at is None:
        return "at an unknown time"
    then = datetime.fromisoformat(measured_at)
    then = then if then.tzinfo else then.replace(tzinfo=timezone.utc)
    seconds = max(((now or datetime.now(timezone.utc)) - then).total_seconds(), 0.0)
    for unit, size, below in (("s", 1, 90), ("min", 60, 90 * 60), ("h", 3600, 48 * 3600)):
        if seconds < below:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds / 86400:.0f} days ago"


def default_cache_dir() -> Path:
    return Path(os.environ.get("PDCOMPILE_CACHE_DIR") or Path.home() / ".cache" / "pdcompile")


def cache_key(
    gm: fx.GraphModule, inputs: Mapping[str, torch.Tensor], settings: ProfileSettings
) -> str:
    nodes = []
    for node in gm.graph.nodes:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        nodes.append(
            [node.name, node.op, str(node.target), repr(module), str(node.meta.get(OUTPUTS))]
        )
    shapes = {k: [list(v.shape), str(v.dtype)] for k, v in inputs.items()}
    # What decides the measurement only; `"cached": False`, and no `loaded_by` for a profile
    # taken alone, keep the file names of older versions.
    measured = {**{name: getattr(settings, name) for name in _KEYED}, "cached": False}
    if not settings.loaded_by:
        del measured["loaded_by"]
    fields = [gm.code, nodes, shapes, gm.training, measured, machine(settings.device)]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def machine(device: str) -> list[str]:
    """What names the machine a profile was measured on, for the key (a cache folder shared
    between machines must not serve one's times to another): the host, the CPU model and, on
    CUDA, the device's name."""
    names = [platform.node(), _cpu_model()]
    if device.startswith("cuda") and torch.cuda.is_available():
        names.append(torch.cuda.get_device_name(torch.device(device)))
    return names


@functools.lru_cache(maxsize=1)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_file(cache: bool | str | Path, key: str) -> Path | None:
    """The file for `key`: in the default directory (`cache=True`), in `cache`, or None (False)."""
    if not cache:
        return None
    directory = default_cache_dir() if cache is True else Path(cache)
    return directory / f"profile-{key[:24]}.json"


def read_cache(
    path: Path, key: str, settled: Callable[[Times, Times], bool]
) -> CachedProfile | None:
    """The profile cached under `key`, or None to measure: no file, another key, an older
    format, or times that `settled(times, slowdown)` finds unsettled by today's thresholds."""
    try:
        doc = json.loads(read_regular_text(path))
        if doc.get("key") != key:
            return None
        if doc.get("format") != CACHE_FORMAT:
            log.info(
                "profile cache %s predates format %d (settled-profile checks, split backward, "
                "spreads); measuring again", path, CACHE_FORMAT,
            )  # fmt: skip
            return None
        times = {name: [float(t) for t in pair] for name, pair in doc["nodes"].items()}
        slowdown = {name: [float(s) for s in pair] for name, pair in doc["slowdown"].items()}
        spread = {name: [float(s) for s in pair] for name, pair in doc["spread"].items()}
        rounds = {name: [int(r) for r in pair] for name, pair in doc["rounds"].items()}
        forward_s, backward_s = (float(t) for t in doc["whole_s"])
        scale = float(doc["backward_scale"])
        measured_at = str(doc["measured_at"])
        datetime.fromisoformat(measured_at)
        bad = _bad_value(times, slowdown, spread, rounds, (forward_s, backward_s, scale))
        if bad:
            log.warning("ignoring profile cache %s: %s, which no measurement gives; profiling "
                        "again (the file is replaced)", path, bad)  # fmt: skip
            return None
        if not settled(times, slowdown):
            log.info("profile cache %s holds unsettled times; measuring again", path)
            return None
        if any(
            len(t) != TIMES_PER_NODE
            or not len(slowdown[n]) == len(spread[n]) == len(rounds[n]) == len(t)
            for n, t in times.items()
        ):
            log.warning(
                "ignoring profile cache %s: a node lacks its %d times; profiling again",
                path, TIMES_PER_NODE,
            )  # fmt: skip
            return None
        return CachedProfile(
            times, slowdown, spread, rounds, measured_at, (forward_s, backward_s), scale
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("ignoring unreadable profile cache %s (%s); profiling again", path, e)
    return None


def _bad_value(
    times: Times, slowdown: Times, spread: Times, rounds: Times, whole: tuple[float, ...]
) -> str | None:
    """The first value of a cache file no measurement gives (NaN, infinite, negative; a
    slowdown or backward scale not > 0), said for the warning, or None."""
    for what, table, least in (("time", times, 0), ("spread", spread, 0), ("rounds", rounds, 0),
                               ("median / fastest", slowdown, None)):  # fmt: skip
        for node, values in table.items():
            for value in values:
                low = value <= 0 if least is None else value < least
                if not math.isfinite(value) or low:
                    return f"node {node}'s {what} is {value!r}"
    if not all(math.isfinite(v) and v >= 0 for v in whole) or whole[2] <= 0:
        return f"the whole graph's times and backward scale are {list(whole)!r}"
    return None


def write_cache(path: Path, key: str, settings: ProfileSettings, profile: CachedProfile) -> None:
    """Write a settled profile: its medians, each time's median / fastest, spread and rounds,
    `measured_at`, and the whole graph's times and backward scale."""
    doc = {
        "format": CACHE_FORMAT,
        "key": key,
        "settings": asdict(replace(settings, cache_path=None)),
        "measured_at": profile.measured_at,
        "nodes": profile.times,
        "slowdown": profile.slowdown,
        "spread": profile.spread,
        "rounds": profile.rounds,
        "whole_s": list(profile.whole_s),
        "backward_scale": profile.backward_scale,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)
