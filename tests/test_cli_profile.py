"""`pdcompile profile`, and `pdcompile graph` over CostGraph JSON and PipeDream profiles."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdcompile import CostGraph, zoo
from pdcompile.cli.handlers import main
from pdcompile.passes.memory import STEP_BYTES

PIPEDREAM = Path(__file__).parent / "data" / "pipedream"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_profile_prints_the_costliest_nodes_and_writes_the_cost_graph(capsys, tmp_path) -> None:
    target = tmp_path / "costs.json"
    code, out, err = run(capsys, "profile", "pdcompile.zoo:mlp", "--no-cache", "--top", "5",
                         "--optimizer", "adam", "--out", str(target))  # fmt: skip
    assert code == 0 and f"wrote {target}" in err
    assert "5 of 12 nodes" in out and "costs from profile, batch size 4" in out
    costs = CostGraph.load(target)
    assert len(costs.nodes) == 12 and costs.meta["optimizer"] == "adam"
    # Adam: two state tensors per parameter and a float32 step count per tensor
    steps = STEP_BYTES["adam"] * len(list(zoo.mlp()[0].parameters()))
    assert costs.totals()["optimizer_bytes"] == 2 * costs.totals()["param_bytes"] + steps > 0


def test_profile_analytic_for_another_device_coarsened(capsys, tmp_path) -> None:
    target = tmp_path / "costs.json"
    code, out, _ = run(capsys, "profile", "pdcompile.zoo:gpt", "--analytic", "--device-model",
                       "h100", "--coarsen", "6", "--out", str(target))  # fmt: skip
    assert code == 0 and "costs from analytic" in out
    costs = CostGraph.load(target)
    assert len(costs.nodes) <= 6 and costs.meta["device_model"] == "h100"
    code, _, err = run(
        capsys, "profile", "pdcompile.zoo:gpt", "--analytic", "--device-model", "tpu"
    )
    assert code == 1 and "unknown device model 'tpu'" in err


def test_graph_shows_a_cost_graph_in_every_format(capsys, tmp_path) -> None:
    target = tmp_path / "costs.json"
    assert main(["profile", "pdcompile.zoo:mlp", "--analytic", "--out", str(target)]) == 0
    capsys.readouterr()
    code, out, _ = run(capsys, "graph", str(target))
    assert code == 0 and "net_0" in out and "12 nodes" in out
    code, out, _ = run(capsys, "graph", str(target), "--format", "json")
    assert CostGraph.from_json(out) == CostGraph.load(target)
    code, out, _ = run(capsys, "graph", str(target), "--format", "dot")
    assert '"x" -> "net_0" [label="512 B"];' in out
    if shutil.which("dot"):
        svg = tmp_path / "costs.svg"
        assert main(["graph", str(target), "--format", "svg", "--out", str(svg)]) == 0
        assert b"<svg" in svg.read_bytes()[:400]


def test_graph_shows_a_pipedream_profile(capsys) -> None:
    path = PIPEDREAM / "vgg16" / "graph.txt"
    code, out, _ = run(capsys, "graph", str(path))
    assert code == 0 and "41 nodes" in out and "Conv2d(3, 64" in out
    code, out, _ = run(capsys, "graph", str(path), "--format", "json")
    assert CostGraph.from_json(out) == CostGraph.from_pipedream(path)


def test_bad_cost_files_are_one_line_errors(capsys, tmp_path) -> None:
    code, _, err = run(capsys, "graph", str(tmp_path / "missing.json"))
    assert code == 2 and "no such file" in err
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "pdcompile.costgraph",\n "version": 1,\n "nodes": [')
    code, _, err = run(capsys, "graph", str(broken))
    assert code == 1 and f"{broken}:3:" in err and err.count("\n") == 1
    bad = tmp_path / "graph.txt"
    bad.write_text("node1 -- Input0 -- forward_compute_time=0.0\n")
    code, _, err = run(capsys, "graph", str(bad))
    assert code == 1 and f"{bad}:1: malformed node line" in err


def test_graph_of_a_cost_file_runs_without_torch() -> None:
    path = PIPEDREAM / "gnmt" / "graph.txt"
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from pdcompile.cli.handlers import main\n"
        f"assert main(['graph', {str(path)!r}, '--format', 'json']) == 0\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules\n"
        "               if sys.modules[m] is not None)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["nodes"]) == 48
