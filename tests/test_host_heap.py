"""`runtime/host_heap.py`: a CPU pipeline rank's freed large blocks go back to the system.

In a fresh process, the pattern that grew the middle ranks' heap (issue 31): a 4 MiB
temporary freed, a small buffer kept where it was, the next 4 MiB temporary. With glibc's
moving mmap threshold every temporary after the first comes from the heap and the small
buffers pin it; with the threshold fixed, each is mapped and unmapped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAP = os.path.join(os.path.dirname(__file__), "..", "runtime", "host_heap.py")
LOAD = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("host_heap", {HEAP!r})
host_heap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_heap)
host_heap.ENABLED = sys.argv[1] == "fixed"
asked = host_heap.return_freed_memory()
"""
PATTERN = (
    LOAD
    + """
import torch
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
kept, before = [], rss()
big = torch.ones(1 << 20)  # 4 MiB
for _ in range(40):
    del big
    kept.append(torch.ones(1 << 14))  # 64 KiB, where the temporary was
    big = torch.ones(1 << 20)
print(json.dumps({"asked": asked, "growth": rss() - before}))
"""
)


def _run(mode: str, script: str = PATTERN, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", script, mode], capture_output=True, text=True, check=True,
        env={**os.environ, **env}, timeout=120,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_fixed_threshold_keeps_the_heap_from_growing_under_pinned_temporaries() -> None:
    fixed, moving = _run("fixed"), _run("glibc")
    assert fixed["asked"] and not moving["asked"]
    assert fixed["growth"] < 12 * 2**20  # the 40 small buffers and the live temporary
    assert moving["growth"] > 3 * fixed["growth"], (fixed, moving)


def test_the_users_own_setting_stands() -> None:
    script = LOAD + "print(json.dumps({'asked': asked}))"
    assert _run("fixed", script)["asked"]
    assert not _run("fixed", script, MALLOC_MMAP_THRESHOLD_="1048576")["asked"]
