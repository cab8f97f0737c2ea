"""The launch path users take: `torchrun` starts one process per stage (gloo on this CPU)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pipeline_torchrun.py"


@pytest.mark.timeout(180)
def test_torchrun_trains_the_example_pipeline(tmp_path) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    result = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", str(EXAMPLE), "--steps", "4"],
        capture_output=True, text=True, timeout=170, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"step \d+: loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 4, result.stdout
    assert losses[-1] < losses[0]  # it trains
