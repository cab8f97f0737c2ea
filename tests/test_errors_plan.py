"""Plans and clusters pdcompile cannot use: each gives its error class and says what and where.

Covered elsewhere: a plan with more stages than nodes
(tests/test_solvers.py::test_a_plan_with_more_stages_than_nodes_is_refused), a plan for more
devices than the job has ranks
(tests/test_compile.py::test_a_plan_for_more_devices_than_ranks_is_refused; its class in
tests/test_errors_distributed.py), and the loaders' fuzzing (tests/test_cost_graph.py,
tests/test_solvers.py::test_plan_json_round_trip_and_corrupt_file).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pdcompile
from pdcompile import Cluster, CostGraph, Plan, zoo
from pdcompile.core.errors import CodegenError, CostError, PartitionError

SGD = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
DATA = Path(__file__).parent / "data" / "pipedream"


@pytest.fixture(scope="module")
def mlp():
    """(model, example, captured graph, analytic CostGraph) of the zoo MLP."""
    model, x = zoo.MLP(p=0.0), torch.randn(8, 32)
    gm = pdcompile.trace(model, (x,))
    return model, x, gm, pdcompile.analyze(gm, (x,), profile=False)


def test_a_plan_for_another_model_names_the_nodes_that_do_not_match(mlp) -> None:
    model, x, gm, _ = mlp
    tokens = torch.randint(0, 128, (8, 16))
    gpt = zoo.GPT(zoo.GPTConfig(dropout=0.0, n_layer=1))
    costs = pdcompile.analyze(pdcompile.trace(gpt, (tokens,)), (tokens,), profile=False)
    other = pdcompile.plan(costs, Cluster.parse("2"))
    with pytest.raises(CodegenError, match=r"the plan names \d+ node\(s\) that are not in the "
                       r"graph of MLP: idx, .*plan on the CostGraph of this graph"):  # fmt: skip
        pdcompile.codegen(gm, other)
    with pytest.raises(CodegenError, match="not in the graph of MLP"):
        pdcompile.compile(model, (x,), loss_fn=F.cross_entropy, optimizer=SGD, plan=other)


def test_more_stages_than_nodes_is_refused(mlp) -> None:
    *_, costs = mlp
    with pytest.raises(PartitionError, match="a straight pipeline gives every machine a stage"):
        pdcompile.plan(costs, Cluster.parse("64"), solver="pipedream", straight=True)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: Cluster([(2, 0)]), "level 0 has bandwidth 0 B/s; give a positive number"),
        (lambda: Cluster([(2, -1e9)]), "level 0 has bandwidth -1000000000.0 B/s"),
        (lambda: Cluster.parse("2@0GB/s"), "level 0 has bandwidth 0.0 B/s"),
        (lambda: Cluster.parse("2@-3GB/s"), "cannot read bandwidth '-3GB'"),
        (lambda: Cluster([(2, 1e9)], memory=0), "device memory must be a positive number of"),
        (lambda: Cluster.parse("2", memory="-1GB"), "cannot read memory '-1GB'"),
        (lambda: Cluster([(0, 1e9)]), "level 0 has 0 devices/groups; use an integer >= 1"),
    ],
)
def test_zero_or_negative_bandwidth_memory_or_devices(make, words) -> None:
    with pytest.raises(PartitionError) as info:
        make()
    assert words in str(info.value)


def test_a_memory_limit_no_plan_fits_says_how_much_is_needed(mlp) -> None:
    *_, costs = mlp
    needed = sum(costs.graph.nodes[n]["param_bytes"] for n in costs.nodes)
    with pytest.raises(PartitionError) as info:
        pdcompile.plan(costs, Cluster.parse("2", memory="1KB"), recompute=False)
    message = str(info.value)
    assert "no placement fits: device memory is 1000 B" in message
    # weights, gradients (as many bytes) and no SGD state: twice the parameters
    assert f"alone take {2 * needed:.4g} B" in message and "use more devices" in message


def _truncated(source: Path, target: Path) -> Path:
    text = source.read_text()
    target.write_text(text[: len(text) // 2])
    return target


def test_truncated_plan_cost_graph_and_profile_files_say_where(mlp, tmp_path: Path) -> None:
    *_, costs = mlp
    costs.save(tmp_path / "costs.json")
    pdcompile.plan(costs, Cluster.parse("2")).save(tmp_path / "plan.json")
    plan_file = _truncated(tmp_path / "plan.json", tmp_path / "plan_cut.json")
    with pytest.raises(
        PartitionError, match=rf"{re.escape(str(plan_file))}:\d+:\d+: not valid JSON .*truncated"
    ):
        Plan.load(plan_file)
    costs_file = _truncated(tmp_path / "costs.json", tmp_path / "costs_cut.json")
    with pytest.raises(
        CostError, match=rf"{re.escape(str(costs_file))}:\d+:\d+: not valid JSON .*truncated"
    ):
        CostGraph.load(costs_file)
    lines = (DATA / "vgg16" / "graph.txt").read_text().splitlines()
    profile = tmp_path / "graph.txt"
    profile.write_text("\n".join([*lines[:3], lines[3][:40]]))  # cut in the 4th line
    with pytest.raises(CostError, match=rf"{re.escape(str(profile))}:4: malformed node line"):
        CostGraph.from_pipedream(profile)
