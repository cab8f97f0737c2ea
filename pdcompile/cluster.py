"""Clusters: devices in a hierarchy of levels; bandwidth per level, memory and speed per device.

Devices are numbered innermost level first: with `8@300GB/s,16@25Gbit/s`, ranks 0-7 share a
server (300 GB/s between them), ranks 8-15 the next one, and servers talk at 25 Gbit/s. A transfer
or all-reduce among a set of ranks runs at the bandwidth of the slowest level the set spans.
Torch-free.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdcompile.errors import PartitionError

# Bandwidth of a level given as a bare count ("4"): 100 Gbit/s, a common NIC and NVLink floor.
DEFAULT_BANDWIDTH = 1.25e10

_UNITS = {
    "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
    "bit": 1 / 8, "Kbit": 1e3 / 8, "Mbit": 1e6 / 8, "Gbit": 1e9 / 8, "Tbit": 1e12 / 8,
}  # fmt: skip
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


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


def _format_rate(value: float) -> str:
    """The shortest `"<number><unit>/s"` that `parse_bytes` reads back as exactly `value`."""
    for unit in ("TB", "GB", "MB", "KB"):
        text = f"{value / _UNITS[unit]:g}"
        if float(text) >= 1 and float(text) * _UNITS[unit] == value:
            return f"{text}{unit}/s"
    return f"{value!r}B/s"


@dataclass(frozen=True)
class Level:
    """`count` groups of the level below (devices, for the innermost), linked at `bandwidth` B/s."""

    count: int
    bandwidth: float


class Cluster:
    """Devices in levels (innermost first), with memory (bytes per device) and relative speeds.

    Args:
        levels: `(count, bandwidth_bytes_per_s)` per level, innermost first.
        memory: bytes per device, or None for no limit.
        speed: relative speed of every device (1.0 is the speed the costs were measured at), or
            None for all 1.0.

    Raises:
        PartitionError: a count below 1, a bandwidth or memory that is not positive, or speeds
            of the wrong length.

    Example:
        >>> c = Cluster.parse("8@300GB/s,16@25Gbit/s", memory="80GB")
        >>> c.num_devices, c.bandwidth(0, 7), c.bandwidth(7, 8)
        (128, 300000000000.0, 3125000000.0)
    """

    def __init__(
        self,
        levels: Sequence[tuple[int, float]],
        memory: float | None = None,
        speed: Sequence[float] | None = None,
    ) -> None:
        if not levels:
            raise PartitionError("a cluster needs at least one level, e.g. Cluster([(4, 1.25e10)])")
        parsed = []
        for i, (count, bandwidth) in enumerate(levels):
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise PartitionError(f"level {i} has {count!r} devices/groups; use an integer >= 1")
            if not (
                isinstance(bandwidth, (int, float)) and math.isfinite(bandwidth) and bandwidth > 0
            ):
                raise PartitionError(
                    f"level {i} has bandwidth {bandwidth!r} B/s; give a positive number of bytes/s"
                )
            parsed.append(Level(count, float(bandwidth)))
        self.levels: tuple[Level, ...] = tuple(parsed)
        self.num_devices = math.prod(level.count for level in self.levels)
        if memory is not None and not (isinstance(memory, (int, float)) and memory > 0):
            raise PartitionError(
                f"device memory must be a positive number of bytes, got {memory!r}"
            )
        self.memory = float(memory) if memory is not None else None
        if speed is not None:
            speed = tuple(float(s) for s in speed)
            if len(speed) != self.num_devices or not all(s > 0 for s in speed):
                raise PartitionError(
                    f"speed needs {self.num_devices} positive numbers (one per device), got "
                    f"{len(speed)}"
                )
        self.speed: tuple[float, ...] | None = speed
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

    def device_speed(self, ranks: Sequence[int]) -> float:
        """The speed of the slowest of `ranks` (replicas wait for each other)."""
        return min(self.speed[r] for r in ranks) if self.speed else 1.0

    @property
    def is_flat(self) -> bool:
        return len(self.levels) == 1

    @classmethod
    def parse(
        cls, text: str, memory: str | float | None = None, speed: Sequence[float] | None = None
    ) -> Cluster:
        """Read `"8@300GB/s,16@25Gbit/s"`, innermost first (a bare count: `DEFAULT_BANDWIDTH`)."""
        levels = []
        for part in text.split(","):
            count_text, _, rate = part.strip().partition("@")
            if not count_text.strip().isdigit():
                raise PartitionError(
                    f"cannot read cluster {text!r}: each level is COUNT or COUNT@BANDWIDTH, "
                    "innermost first, e.g. 8@300GB/s,16@25Gbit/s"
                )
            rate = rate.strip().removesuffix("/s")
            bandwidth = parse_bytes(rate, "bandwidth") if rate else DEFAULT_BANDWIDTH
            levels.append((int(count_text), bandwidth))
        return cls(levels, parse_bytes(memory, "memory") if memory is not None else None, speed)

    def __str__(self) -> str:
        return ",".join(f"{lv.count}@{_format_rate(lv.bandwidth)}" for lv in self.levels)

    def __repr__(self) -> str:
        memory = f", memory={self.memory:g}" if self.memory is not None else ""
        return f"Cluster({str(self)!r}{memory})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cluster) and self.to_dict() == other.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return {
            "levels": [[lv.count, lv.bandwidth] for lv in self.levels],
            "memory": self.memory,
            "speed": list(self.speed) if self.speed else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        try:
            return cls([tuple(lv) for lv in data["levels"]], data.get("memory"), data.get("speed"))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            shown = repr(data) if len(repr(data)) <= 200 else repr(data)[:197] + "..."
            raise PartitionError(
                f"malformed cluster description {shown} ({type(e).__name__}: {e}); write it "
                "as {'levels': [[count, bytes_per_s], ...], 'memory': bytes or null, "
                "'speed': [one per device] or null}"
            ) from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Cluster:
        try:
            return cls.from_dict(json.loads(text))
        except (json.JSONDecodeError, RecursionError) as e:
            raise PartitionError(f"cluster JSON is not valid: {e}") from None
