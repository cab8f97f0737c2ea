"""Clusters: devices in a hierarchy of levels; bandwidth and latency per level, memory, speed and
the runtime's own costs per device.

Devices are numbered innermost level first: with `8@300GB/s,16@25Gbit/s`, ranks 0-7 share a
server (300 GB/s between them), ranks 8-15 the next one, and servers talk at 25 Gbit/s. A transfer
or all-reduce among a set of ranks runs at the bandwidth of the slowest level the set spans, and
each message also waits that level's latency (`2@1GB/s+100us`). Every public function taking a
cluster takes the same spellings (`Cluster.coerce`, `SPELLINGS`): a `Cluster`, its text, or a
number of devices. Torch-free.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pdcompile.core.errors import PartitionError

# Bandwidth of a level given as a bare count ("4"): 100 Gbit/s, a common NIC and NVLink floor.
DEFAULT_BANDWIDTH = 1.25e10
# The most devices a cluster may have (all levels multiplied): the largest accelerator clusters
# built hold about 10^5; beyond, a typo ("99999999999") would exhaust memory listing ranks.
MAX_DEVICES = 1 << 17
# The cluster a job measures for itself (`compile(cluster="auto")`, runtime/cluster_measure.py)
AUTO = "auto"
# What every public function taking a cluster accepts (`Cluster.coerce`)
SPELLINGS = (
    "a pdcompile.Cluster, its text such as '4' or '8@300GB/s,2@25Gbit/s+5us' "
    "(COUNT[@BANDWIDTH][+LATENCY] per level, innermost first), or a number of devices >= 1 "
    "such as 4"
)

_UNITS = {
    "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
    "bit": 1 / 8, "Kbit": 1e3 / 8, "Mbit": 1e6 / 8, "Gbit": 1e9 / 8, "Tbit": 1e12 / 8,
}  # fmt: skip
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_PER_SECOND = {"s": 1, "ms": 1e3, "us": 1e6, "ns": 1e9}  # units of time in a second
# a level: COUNT[@BANDWIDTH][+LATENCY]; the latency's "+" is not an exponent's sign ("1e+9B/s")
_LEVEL = re.compile(r"^\s*(\d+)\s*(?:@([^@]*?))?\s*(?:(?<![eE])\+(.*))?$")


def parse_bytes(text: str | float, what: str = "size") -> float:
    """`"80GB"` -> `8e10`; `"25Gbit"` -> `3.125e9`; a number is taken as bytes."""
    if isinstance(text, (int, float)):
        return float(text)
    match = _QUANTITY.match(text)
    if not match or (match.group(2) or "B") not in _UNITS:
        raise PartitionError(
            f"cannot read {what} {text!r}: write a number with a unit such as 80GB, 16GiB, "
            f"25Gbit ({', '.join(_UNITS)})"
        )
    return float(match.group(1)) * _UNITS[match.group(2) or "B"]


def parse_seconds(text: str | float, what: str = "latency") -> float:
    """`"100us"` -> `1e-4`; `"2.5ms"` -> `0.0025`; a number is taken as seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    match = _QUANTITY.match(text)
    if not match or (match.group(2) or "s") not in _PER_SECOND:
        raise PartitionError(
            f"cannot read {what} {text!r}: write a number with a unit such as 100us, 2ms, 0.5s "
            f"({', '.join(_PER_SECOND)})"
        )
    return float(match.group(1)) / _PER_SECOND[match.group(2) or "s"]


def _format_seconds(value: float) -> str:
    """The shortest `"<number><unit>"` that `parse_seconds` reads back as exactly `value`."""
    for unit, per_second in _PER_SECOND.items():
        text = f"{value * per_second:g}"
        if float(text) >= 1 and float(text) / per_second == value:
            return f"{text}{unit}"
    return f"{value!r}s"


def _format_rate(value: float) -> str:
    """The shortest `"<number><unit>/s"` that `parse_bytes` reads back as exactly `value`."""
    for unit in ("TB", "GB", "MB", "KB"):
        text = f"{value / _UNITS[unit]:g}"
        if float(text) >= 1 and float(text) * _UNITS[unit] == value:
            return f"{text}{unit}/s"
    return f"{value!r}B/s"


@dataclass(frozen=True)
class Level:
    """`count` groups of the level below (devices, for the innermost), linked at `bandwidth` B/s;
    every message between them also takes `latency` seconds."""

    count: int
    bandwidth: float
    latency: float = 0.0


@dataclass(frozen=True)
class RuntimeCosts:
    """What the runtime's own work costs on a device, besides compute and transfers.

    Bandwidths count bytes read plus bytes written per second (None: free). `memory_bandwidth`
    moves what waited in memory since its last use: weights and optimizer state (the optimizer's
    update, weight copies, flattening gradients for an all-reduce). `cache_bandwidth` (None: the
    memory bandwidth) moves what the compute just produced: gradients added to those held or
    cloned to the live weights, activations packed into a message. `tensor_s`: fixed seconds
    per tensor an action copies, updates or swaps in. `message_s`: fixed seconds a rank spends
    on each message it receives (waiting, unpacking) and, unless `send_s` is given, sends
    (packing, posting).
    `collective_s`: fixed seconds of an all-reduce besides its latencies (the backend's
    rounds of synchronisation: gloo's take ~0.4 ms on a 2-core host). `collective_bandwidth`
    (None: no bound): the bytes per second an all-reduce moves between two ranks at most, by
    its own work (gloo reduces and copies through buffers of its own: on loopback here
    0.80-1.12 GB/s where a message moved 1.09-2.37 GB/s, 10 calibrations); an all-reduce runs
    at the smaller of it and the link's bandwidth.
    `fb_overlap`: the share of the shorter part of an overlapped forward-backward pair (`FB`,
    `dualpipev`) that runs hidden under the longer: the pair takes max(F, B) + (1 - fb_overlap)
    min(F, B). 0 (the default) runs them one after the other, as a CPU does; a GPU running them
    on two streams hides part of the shorter, 1 all of it.
    The defaults cost nothing; docs/simulator.md has the formulas and how they are measured.
    """

    memory_bandwidth: float | None = None
    tensor_s: float = 0.0
    message_s: float = 0.0
    cache_bandwidth: float | None = None
    collective_s: float = 0.0
    send_s: float | None = None
    collective_bandwidth: float | None = None
    fb_overlap: float = 0.0

    def __post_init__(self) -> None:
        for name in ("memory_bandwidth", "cache_bandwidth", "collective_bandwidth"):
            bandwidth = getattr(self, name)
            if bandwidth is not None and not (_number(bandwidth) and bandwidth > 0):
                raise PartitionError(
                    f"{name} must be a positive number of bytes/s or None, got {bandwidth!r}"
                )
        for name in ("tensor_s", "message_s", "collective_s", "send_s"):
            value = getattr(self, name)
            if name == "send_s" and value is None:
                continue
            if not (_number(value) and value >= 0):
                raise PartitionError(f"{name} must be a number of seconds >= 0, got {value!r}")
        if not (_number(self.fb_overlap) and 0 <= self.fb_overlap <= 1):
            raise PartitionError(
                f"fb_overlap must be a share from 0 to 1 of an overlapped pair's shorter part, "
                f"got {self.fb_overlap!r}"
            )

    @property
    def sent_s(self) -> float:
        """Fixed seconds of a send: `send_s`, else `message_s`."""
        return self.message_s if self.send_s is None else self.send_s

    def moved_s(self, nbytes: float, tensors: int = 0, *, cached: bool = False) -> float:
        """Seconds to read and write `nbytes` in all over `tensors` tensors (`cached`: data the
        compute just produced)."""
        bandwidth = (cached and self.cache_bandwidth) or self.memory_bandwidth
        return (nbytes / bandwidth if bandwidth else 0.0) + tensors * self.tensor_s


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _hosts_text(hosts: list[list[Any]]) -> str:
    """`[[host, [ranks]], ...]` as "2 hosts: a (ranks 0-1), b (ranks 2-3)"."""

    def spans(ranks: list[int]) -> str:
        consecutive = ranks == list(range(ranks[0], ranks[0] + len(ranks)))
        if len(ranks) > 1 and consecutive:
            return f"ranks {ranks[0]}-{ranks[-1]}"
        return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"

    parts = [f"{name} ({spans(ranks)})" for name, ranks in hosts]
    return f"{len(hosts)} host{'s' if len(hosts) > 1 else ''}: {', '.join(parts)}"


def check_devices(count: int) -> int:
    """`count` devices, unless it is above `MAX_DEVICES` (`PartitionError`)."""
    if count > MAX_DEVICES:
        raise PartitionError(
            f"a cluster of {count} devices is above the cap of {MAX_DEVICES} "
            "(pdcompile.core.cluster.MAX_DEVICES); check the counts of its levels (innermost "
            "first, multiplied together), or plan for a part of the cluster"
        )
    return count


class Cluster:
    """Devices in levels (innermost first), with memory (bytes per device), relative speeds and
    the runtime's own costs.

    Args:
        levels: `(count, bandwidth_bytes_per_s)` or `(count, bandwidth, latency_s)` per level,
            innermost first.
        memory: bytes per device, or None for no limit.
        speed: relative speed of every device (1.0 is the speed the costs were measured at), or
            None for all 1.0.
        runtime: what the runtime's copies, updates and messages cost per device (default: free).
        measured: how a measured cluster was measured (`runtime/cluster_measure.py`: when, how
            long, the hosts, the pairs and figures per level, the speed probe), JSON values; None
            for a cluster written by hand. It travels with the cluster (`to_dict`) and
            `describe_measurement()` prints it.

    Raises:
        PartitionError: a count below 1, more than `MAX_DEVICES` devices in all, a bandwidth
            or memory that is not positive, a negative latency, or speeds of the wrong length.

    Example:
        >>> c = Cluster.parse("8@300GB/s,16@25Gbit/s+5us", memory="80GB")
        >>> c.num_devices, c.bandwidth(0, 7), c.bandwidth(7, 8), c.latency(7, 8)
        (128, 300000000000.0, 3125000000.0, 5e-06)
    """

    def __init__(
        self,
        levels: Sequence[tuple[int, float] | tuple[int, float, float]],
        memory: float | None = None,
        speed: Sequence[float] | None = None,
        runtime: RuntimeCosts | None = None,
        measured: dict[str, Any] | None = None,
    ) -> None:
        if not levels:
            raise PartitionError("a cluster needs at least one level, e.g. Cluster([(4, 1.25e10)])")
        parsed = []
        for i, level in enumerate(levels):
            if len(level) not in (2, 3):
                raise PartitionError(
                    f"level {i} is {level!r}; give (count, bytes_per_s) or (count, bytes_per_s, "
                    "latency_s)"
                )
            count, bandwidth, latency = (*level, 0.0)[:3]
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise PartitionError(f"level {i} has {count!r} devices/groups; use an integer >= 1")
            if not (_number(bandwidth) and bandwidth > 0):
                raise PartitionError(
                    f"level {i} has bandwidth {bandwidth!r} B/s; give a positive number of bytes/s"
                )
            if not (_number(latency) and latency >= 0):
                raise PartitionError(
                    f"level {i} has latency {latency!r} s; give a number of seconds >= 0"
                )
            parsed.append(Level(count, float(bandwidth), float(latency)))
        self.levels: tuple[Level, ...] = tuple(parsed)
        self.num_devices = check_devices(math.prod(level.count for level in self.levels))
        if memory is not None and not (_number(memory) and memory > 0):
            raise PartitionError(
                f"device memory must be a positive number of bytes, got {memory!r}"
            )
        self.memory = float(memory) if memory is not None else None
        if speed is not None:
            speed = tuple(float(s) for s in speed)
            if len(speed) != self.num_devices or not all(_number(s) and s > 0 for s in speed):
                raise PartitionError(
                    f"speed needs {self.num_devices} positive numbers (one per device), got "
                    f"{len(speed)}"
                )
        self.speed: tuple[float, ...] | None = speed
        if runtime is not None and not isinstance(runtime, RuntimeCosts):
            raise PartitionError(f"runtime must be a RuntimeCosts or None, got {runtime!r}")
        self.runtime = runtime or RuntimeCosts()
        if measured is not None and not isinstance(measured, dict):
            raise PartitionError(f"measured must be a dict or None, got {measured!r}")
        self.measured = json.loads(json.dumps(measured)) if measured is not None else None
        sizes, size = [], 1
        for level in self.levels:
            size *= level.count
            sizes.append(size)
        self._group_sizes = tuple(sizes)  # devices per group at each level

    def level_of(self, first: int, last: int) -> int:
        """The slowest level spanned by ranks `first..last` (0 if they share an innermost group)."""
        for k, size in enumerate(self._group_sizes):
            if first // size == last // size:
                return k
        raise PartitionError(f"ranks {first}..{last} are outside a cluster of {self.num_devices}")

    def bandwidth(self, first: int, last: int) -> float:
        """Bandwidth (B/s) of the slowest level spanned by ranks `first..last`."""
        return self.levels[self.level_of(first, last)].bandwidth

    def latency(self, first: int, last: int) -> float:
        """Seconds per message across the slowest level spanned by ranks `first..last`."""
        return self.levels[self.level_of(first, last)].latency

    def device_speed(self, ranks: Sequence[int]) -> float:
        """The speed of the slowest of `ranks` (replicas wait for each other)."""
        return min(self.speed[r] for r in ranks) if self.speed else 1.0

    def describe_measurement(self) -> list[str]:
        """How this cluster was measured, a line per fact (none for a cluster written by hand)."""
        m = self.measured
        if not m:
            return []
        source = f"from the cache {m['cache']}" if m.get("from_cache") else "measured by the job"
        lines = [f"cluster {self} {source} at {m['at']} in {m['seconds']:.1f} s "
                 f"({_hosts_text(m['hosts'])})"]  # fmt: skip
        for level in m["levels"]:
            pairs = ", ".join(f"{a}<->{b}" for a, b in level["pairs"])
            reduce = level.get("allreduce_bandwidth")
            lines.append(
                f"  {level['name']}: {_format_rate(level['bandwidth'])} (slowest of ranks "
                f"{pairs}, both directions), "
                + (
                    f"latency {_format_seconds(level['latency'])}"
                    if level["latency"]
                    else "latency within the send and receive costs"
                )  # fmt: skip
                + (f", all-reduce {reduce / 1e9:.3g} GB/s" if reduce else "")
            )
        if m.get("speed"):
            lines.append(f"  speeds: {m['speed']}")
        if m.get("memory"):
            lines.append(f"  memory: {m['memory']}")
        return [*lines, *(f"  note: {note}" for note in m.get("notes", ()))]

    @property
    def is_flat(self) -> bool:
        return len(self.levels) == 1

    @classmethod
    def coerce(cls, cluster: Cluster | str | int, what: str = "cluster") -> Cluster:
        """The cluster `cluster` spells: the one spelling rule of every public function taking a
        cluster (`plan`, `evaluate`, `simulate`, `compile`, `lower_bound`, `make_plan`, `Plan`).

        Accepted (`SPELLINGS`): a `Cluster` (itself); its text, read by `parse` ("4",
        "8@300GB/s,2@25Gbit/s+5us"); or a number of devices, an int >= 1 (`4` is `"4"`: one
        level at `DEFAULT_BANDWIDTH`).

        Raises:
            PartitionError: anything else, or text `parse` cannot read; the message names
                `what` (the argument), the value given and the accepted spellings.

        Example:
            >>> Cluster.coerce(4) == Cluster.coerce("4") == Cluster.parse("4")
            True
        """
        if isinstance(cluster, Cluster):
            return cluster
        if cluster == AUTO:
            raise PartitionError(
                f"{what}='auto' is measured by a running job of two or more ranks (compile "
                "under torchrun measures it, and so does `torchrun ... pdcompile calibrate "
                "--cluster`); here give the cluster: " + SPELLINGS
            )
        if isinstance(cluster, str):
            try:
                return cls.parse(cluster)
            except PartitionError as exc:
                raise PartitionError(f"{what}={cluster!r}: {exc}") from None
        if isinstance(cluster, int) and not isinstance(cluster, bool) and cluster >= 1:
            try:
                return cls([(cluster, DEFAULT_BANDWIDTH)])
            except PartitionError as exc:
                raise PartitionError(f"{what}={cluster}: {exc}") from None
        shown = repr(cluster) if len(repr(cluster)) <= 80 else repr(cluster)[:77] + "..."
        raise PartitionError(f"{what} must be {SPELLINGS}; got {type(cluster).__name__} {shown}")

    @classmethod
    def parse(
        cls,
        text: str,
        memory: str | float | None = None,
        speed: Sequence[float] | None = None,
        runtime: RuntimeCosts | None = None,
    ) -> Cluster:
        """Read `"8@300GB/s,16@25Gbit/s+5us"`, innermost first: `COUNT[@BANDWIDTH][+LATENCY]`
        per level (no bandwidth: `DEFAULT_BANDWIDTH`; no latency: 0)."""
        if not isinstance(text, str):
            raise PartitionError(
                f"Cluster.parse reads text such as '8@300GB/s,16@25Gbit/s', got "
                f"{type(text).__name__} {text!r}; for other spellings use Cluster.coerce"
            )
        levels, devices = [], 1
        for part in text.split(","):
            match = _LEVEL.match(part)
            count, rate, latency = match.groups() if match else ("", None, None)
            # "2@" and "2@+": a bandwidth or latency announced but not written
            if match is None or (rate is not None and not rate.strip()) or latency == "":
                raise PartitionError(
                    f"cannot read cluster {text!r}: each level is COUNT, COUNT@BANDWIDTH or "
                    "COUNT@BANDWIDTH+LATENCY, innermost first, e.g. 8@300GB/s,16@25Gbit/s+5us"
                )
            devices = check_devices(devices * int(count))  # before a huge count is used
            rate = (rate or "").strip().removesuffix("/s")
            bandwidth = parse_bytes(rate, "bandwidth") if rate else DEFAULT_BANDWIDTH
            levels.append((int(count), bandwidth, parse_seconds(latency) if latency else 0.0))
        size = parse_bytes(memory, "memory") if memory is not None else None
        return cls(levels, size, speed, runtime)

    def __str__(self) -> str:
        return ",".join(
            f"{lv.count}@{_format_rate(lv.bandwidth)}"
            + (f"+{_format_seconds(lv.latency)}" if lv.latency else "")
            for lv in self.levels
        )

    def __repr__(self) -> str:
        memory = f", memory={self.memory:g}" if self.memory is not None else ""
        runtime = f", runtime={self.runtime!r}" if self.runtime != RuntimeCosts() else ""
        return f"Cluster({str(self)!r}{memory}{runtime})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cluster) and self.to_dict() == other.to_dict()

    def to_dict(self) -> dict[str, Any]:
        data = {
            "levels": [[lv.count, lv.bandwidth, lv.latency] for lv in self.levels],
            "memory": self.memory,
            "speed": list(self.speed) if self.speed else None,
            "runtime": asdict(self.runtime),
        }
        if self.measured is not None:
            data["measured"] = self.measured
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        """A cluster from `to_dict()`'s output (files without latencies or `runtime` load too)."""
        try:
            runtime = RuntimeCosts(**data["runtime"]) if data.get("runtime") is not None else None
            levels = [tuple(lv) for lv in data["levels"]]
            return cls(levels, data.get("memory"), data.get("speed"), runtime,
                       data.get("measured"))  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            shown = repr(data) if len(repr(data)) <= 200 else repr(data)[:197] + "..."
            raise PartitionError(
                f"malformed cluster description {shown} ({type(e).__name__}: {e}); write it "
                "as {'levels': [[count, bytes_per_s, latency_s], ...], 'memory': bytes or null, "
                "'speed': [one per device] or null, 'runtime': {'memory_bandwidth': bytes_per_s "
                "or null, 'tensor_s': s, 'message_s': s, 'cache_bandwidth': bytes_per_s or null} "
                "or null}"
            ) from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Cluster:
        try:
            return cls.from_dict(json.loads(text))
        except (json.JSONDecodeError, RecursionError) as e:
            raise PartitionError(f"cluster JSON is not valid: {e}") from None
