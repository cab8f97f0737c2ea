"""The launch path users take: `torchrun` starts one process per stage (gloo on this CPU)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "pipeline_torchrun.py"


def torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    return subprocess.run(
        [launcher, "--standalone", "--nproc_per_node", "2", *args],
        capture_output=True, text=True, timeout=170, cwd=cwd,
    )  # fmt: skip


@pytest.mark.timeout(180)
def test_torchrun_trains_the_example_pipeline(tmp_path) -> None:
    result = torchrun(str(EXAMPLE), "--steps", "4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"step \d+: loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 4, result.stdout
    assert losses[-1] < losses[0]  # it trains


@pytest.mark.timeout(180)
def test_the_readme_demo_trains_digits_with_every_method(tmp_path) -> None:
    """`examples/train_digits.py`, shortened: one seed, six epochs."""
    result = torchrun(str(EXAMPLES / "train_digits.py"), "--seeds", "1", "--epochs", "6",
                      "--out", str(tmp_path / "digits"), cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.lstrip().startswith("digits: samples seen until 95%")  # the table first
    assert "after each epoch" not in result.stdout  # per-epoch detail only with --verbose
    summary = json.loads((tmp_path / "digits" / "results.json").read_text())["summary"]
    assert set(summary) == {"pipedream", "1f1b", "ddp"}
    assert all(s["median_final_accuracy"] > 0.8 for s in summary.values()), summary
    # 1f1b is gradient accumulation over the same rows as DDP's update: the same accuracy
    sync = (summary["1f1b"]["median_final_accuracy"], summary["ddp"]["median_final_accuracy"])
    assert abs(sync[0] - sync[1]) < 0.02, summary
