"""A CPU quota for one process: a cgroup (v1 `cpu.cfs_quota_us`, v2 `cpu.max`) holding it.

    with cpu_quota(pid, 0.5):   # the process runs at most half of one CPU; QuotaUnavailable else
        ...

The cgroup is made under the cpu controller's root with a name carrying this process's id, and
removed on exit (its processes moved back to the root first), even after a failure. Needs root
and a writable cgroup hierarchy; used by tests/test_cluster_measure.py and
benchmarks/slow_rank.py.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

PERIOD_US = 100_000
_counter = itertools.count()


class QuotaUnavailable(RuntimeError):
    """No writable cgroup with a CPU controller here."""


def _roots() -> tuple[Path, str]:
    """(the cpu controller's root, "v1" or "v2")."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1, "v1"
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text():
        return v2, "v2"
    raise QuotaUnavailable("no cgroup cpu controller (v1 cpu.cfs_quota_us or v2 cpu.max) here")


@contextlib.contextmanager
def cpu_quota(pid: int, cpus: float) -> Iterator[Path]:
    """Hold process `pid` (its threads too) to `cpus` CPUs while the block runs."""
    root, version = _roots()
    group = root / f"pdcompile-test-{os.getpid()}-{next(_counter)}"
    try:
        group.mkdir()
    except OSError as exc:
        raise QuotaUnavailable(f"cannot make a cgroup under {root}: {exc}") from None
    procs = "cgroup.procs"
    try:
        if version == "v1":
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(int(cpus * PERIOD_US)))
        else:
            (group / "cpu.max").write_text(f"{int(cpus * PERIOD_US)} {PERIOD_US}")
        (group / procs).write_text(str(pid))
        yield group
    finally:
        with contextlib.suppress(OSError):
            for task in (group / procs).read_text().split():
                with contextlib.suppress(OSError):
                    (root / procs).write_text(task)
        with contextlib.suppress(OSError):
            group.rmdir()
