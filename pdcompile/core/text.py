"""Small torch-free text helpers shared by the reports: human units and DOT quoting."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """`1536` -> `"1.5 KiB"`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def human_seconds(seconds: float) -> str:
    """`0.0012` -> `"1.20 ms"`."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale or unit == "us":
            return f"{seconds / scale:.2f} {unit}"
    raise AssertionError


def dot_quote(text: str) -> str:
    """A Graphviz double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
