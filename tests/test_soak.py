"""The soak run (`benchmarks/soak.py`) on a tiny setting: a rank SIGKILLed mid-run, the others
stopped by the step timeout, a resume from the last verified checkpoint equal to the
uninterrupted run; and its checkpoint choice and memory summary on made-up inputs."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("benchmark_soak", SCRIPT)
assert _spec is not None and _spec.loader is not None
soak = sys.modules["benchmark_soak"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

TIMEOUT_S = 240  # hard limit of the whole tiny soak (about 50 s on a loaded 2-core machine)


@pytest.mark.faults  # a job stopped and resumed against an uninterrupted one: the faults tier
def test_resumed_run_equals_uninterrupted_run(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    command = [sys.executable, str(SCRIPT), "--minibatches", "40", "--every", "10",
               "--schedules", "pipedream", "--timeout", "10", "--sample-every", "5",
               "--workdir", str(tmp_path / "work"), "--json", str(out)]  # fmt: skip
    # a session of its own: on a timeout the soak's ranks are killed with it
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True, text=True)  # fmt: skip
    try:
        log, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        log, _ = process.communicate()
        pytest.fail(f"the soak ran past {TIMEOUT_S} s:\n{log[-3000:]}")
    assert process.returncode == 0, log[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    kill = result["kill"]
    assert 10 <= kill["minibatch"] < 39
    assert result["victim"] == "died (exit code -9)"  # really SIGKILLed
    assert len(result["survivors"]) == 2 and result["survivors_timed_out"], result["survivors"]
    # the newest checkpoint at or before the kill (a save killed half-way may be missing)
    assert kill["minibatch"] - 10 <= result["resumed_from"] <= kill["minibatch"] + 1
    assert result["resumed_from"] % 10 == 0 and result["resumed_from"] >= 10
    assert result["errors"] == {}
    assert result["equal"] and result["max_diff"] == 0 and result["differ"] == []
    assert result["checkpoints_equal"] and result["losses_equal"]
    assert result["losses_compared"] == (40 - result["resumed_from"]) // 5
    for rank in ("0", "1", "2"):
        memory = result["memory"][rank]
        assert memory["measure"] == "rss" and memory["peak"] >= memory["steady_max"] > 0


def test_last_checkpoint_skips_what_an_interrupted_save_left(tmp_path: Path) -> None:
    from pdcompile.runtime import manifest

    for name, content in (("step-000010", b"a"), ("step-000020", b"b"), ("step-000030", b"c")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(content)
        files = {"__0_0.distcp": (1, manifest.sha256(str(folder / "__0_0.distcp")))}
        manifest.write(str(folder), manifest.Manifest(files=files, world_size=1, step=10))
    (tmp_path / "step-000030" / "__0_0.distcp").write_bytes(b"X")  # altered after the save
    (tmp_path / ".step-000040.tmp-1234").mkdir()  # a save killed before its commit
    path, leftovers = soak.last_checkpoint(str(tmp_path))
    assert path == str(tmp_path / "step-000020")
    assert sorted(leftovers) == [".step-000040.tmp-1234", "step-000030"]
    assert soak.last_checkpoint(str(tmp_path / "none")) == (None, [])


def test_memory_summary_growth_and_slope() -> None:
    mib = 2**20
    # (minibatch, RSS, CUDA bytes, actions logged): a warm-up jump, then 1 MiB per 100
    samples = [[m, 100 * mib + (m * mib // 100 if m > 100 else 0), None, 7]
               for m in range(10, 510, 10)]  # fmt: skip
    summary = soak.memory_summary(samples, every=100, peak=600 * mib)
    assert summary["measure"] == "rss" and summary["peak"] == 600 * mib
    assert summary["steady_max"] == 105 * mib and summary["actions_logged"] == 7
    # steady samples 110..500: the first quarter ends at 200, the second half starts at 310
    assert summary["growth"] == (500 - 200) * mib // 100
    assert summary["slope_per_1000"] == pytest.approx(10 * mib)  # over 310..500
    flat = soak.memory_summary([[m, 5 * mib, None, 0] for m in range(10, 510, 10)], 100, 0)
    assert flat["growth"] == 0 and flat["slope_per_1000"] == pytest.approx(0, abs=1e-6)


def test_saves_into_new_folders_keep_no_state(tmp_path: Path) -> None:
    """What the soak found: each save into a new folder (ckpt/step-N) left ~1.7 KB behind (a
    glob pattern cached per folder name) until 32,768 names."""
    import tracemalloc

    from pdcompile.runtime import manifest

    def prepare(first: int, count: int) -> None:
        for i in range(first, first + count):
            assert manifest.prepare(str(tmp_path / f"step-{i:06d}")) == []

    prepare(0, 50)  # warm-up
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        prepare(50, 500)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept / 500 < 100, f"{kept / 500:.0f} bytes kept per save"
