"""Every public function taking a cluster takes the same spellings (`Cluster.coerce`): a
`Cluster`, its text, or a number of devices; anything else is a `PartitionError` naming the
argument, the value given and the spellings accepted (issue 18: `plan(costs, "2")` failed with
an AttributeError where `compile` took the string)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from pipeline_support import OPTIMIZERS, mlp_case

import pdcompile
from pdcompile import Cluster, CostGraph, PartitionError, Plan, Stage
from pdcompile.cli.handlers import main
from pdcompile.passes.planning.cost_model import Pricing
from pdcompile.passes.planning.evaluation import lower_bound
from pdcompile.passes.planning.solver_kit import make_plan

TWO = Cluster.parse("2")


def _costs() -> CostGraph:
    g = CostGraph(batch_size=4)
    for i, t in enumerate((1.0, 2.0)):
        g.add_node(f"n{i}", forward_s=t / 3, backward_s=2 * t / 3, param_bytes=8, grad_bytes=8,
                   activation_bytes=4, output_bytes=4)  # fmt: skip
    g.add_edge("n0", "n1", 4)
    return g


G = _costs()
OPTIONS = {"schedule": "1f1b", "num_microbatches": 2}
STAGES = (Stage(index=0, nodes=("n0", "n1"), replicas=1, ranks=(0,)),)
PLAN = pdcompile.evaluate(Plan(stages=STAGES, cluster=TWO, num_microbatches=2), G)


def _compile(cluster: Any) -> Cluster:
    model, x, _, loss_fn = mlp_case()
    pipe = pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"],
                             cluster=cluster, solver="blocks", profile=False)  # fmt: skip
    return pipe.plan.cluster


# public function -> the cluster it ends up with for a given spelling
TAKERS: dict[str, Callable[[Any], Any]] = {
    "plan": lambda c: pdcompile.plan(G, c, num_microbatches=2).cluster,
    "evaluate": lambda c: pdcompile.evaluate(PLAN, G, cluster=c).cluster,
    "simulate": lambda c: pdcompile.simulate(PLAN, cluster=c).plan.cluster,
    "lower_bound": lambda c: lower_bound(G, c),
    "make_plan": lambda c: make_plan(G, c, [(("n0", "n1"), 1)], OPTIONS, "hand").cluster,
    "Plan": lambda c: Plan(stages=STAGES, cluster=c).cluster,
    "Pricing.of": lambda c: Pricing.of(c, OPTIONS).cluster,
    "Cluster.coerce": Cluster.coerce,
    "compile": _compile,
}
EXPECTED = {"lower_bound": lower_bound(G, TWO)}


@pytest.mark.parametrize("spelling", ["2", 2, TWO], ids=["text", "count", "Cluster"])
@pytest.mark.parametrize("name", list(TAKERS))
def test_every_taker_accepts_every_spelling(name: str, spelling: Any) -> None:
    assert TAKERS[name](spelling) == EXPECTED.get(name, TWO)


@pytest.mark.parametrize("name", list(TAKERS))
def test_a_malformed_text_names_the_argument_and_the_format(name: str) -> None:
    with pytest.raises(PartitionError, match=r"cluster='2x': cannot read cluster '2x': each "
                       r"level is COUNT, COUNT@BANDWIDTH or COUNT@BANDWIDTH\+LATENCY"):  # fmt: skip
        TAKERS[name]("2x")


@pytest.mark.parametrize("bad", [[2], 0, True, 2.0, {"levels": [[2, 1e9]]}],
                         ids=["list", "zero", "bool", "float", "dict"])  # fmt: skip
@pytest.mark.parametrize("name", list(TAKERS))
def test_a_wrong_type_names_the_argument_the_value_and_the_spellings(name: str, bad: Any) -> None:
    with pytest.raises(PartitionError) as caught:
        TAKERS[name](bad)
    text = str(caught.value)
    assert text.startswith("cluster must be a pdcompile.Cluster, its text such as '4'")
    assert "or a number of devices >= 1" in text and f"got {type(bad).__name__} {bad!r}" in text


def test_no_cluster_means_the_plans_own_for_evaluate_and_simulate() -> None:
    on_four = pdcompile.evaluate(PLAN, G, cluster="4")
    assert on_four.cluster == Cluster.parse("4")
    assert pdcompile.evaluate(on_four, G).cluster == on_four.cluster
    assert pdcompile.simulate(on_four).plan.cluster == on_four.cluster


def test_parse_refuses_what_is_not_text() -> None:
    with pytest.raises(PartitionError, match="Cluster.parse reads text .* got int 4; for other "
                       "spellings use Cluster.coerce"):  # fmt: skip
        Cluster.parse(4)


def test_the_command_line_takes_the_text_and_names_a_bad_one(capsys, tmp_path) -> None:
    costs = tmp_path / "costs.json"
    G.save(costs)
    assert main(["plan", str(costs), "--cluster", "2", "--microbatches", "2"]) == 0
    assert "Plan by dynprog for 2@12.5GB/s (2 devices)" in capsys.readouterr().out
    assert main(["plan", str(costs), "--cluster", "2x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pdcompile: error: cannot read cluster '2x': each level is COUNT")


@pytest.mark.parametrize("text", ["2@", "2@+", "2@ +5us", "2@+5us", "2@1GB/s+", "8@300GB/s,2@"])
@pytest.mark.parametrize("name", ["plan", "simulate", "Cluster.coerce"])
def test_a_bandwidth_or_latency_announced_but_not_written_is_refused(name: str, text: str) -> None:
    # "2@" and "2@+" were read as the default bandwidth (issue 22)
    with pytest.raises(PartitionError, match=re.escape(f"cluster={text!r}: cannot read cluster "
                       f"{text!r}: each level is COUNT, COUNT@BANDWIDTH or")):  # fmt: skip
        TAKERS[name](text)


@pytest.mark.parametrize("text", ["2+5us", "2@1e+9B/s", "2@1GB/s+5us", "4@10GB/s,2@1GB/s+1ms"])
def test_the_written_parts_still_read(text: str) -> None:
    cluster = Cluster.parse(text)
    assert Cluster.parse(str(cluster)) == cluster


def test_a_huge_count_is_refused_on_the_command_line(capsys, tmp_path) -> None:
    costs = tmp_path / "costs.json"
    G.save(costs)
    assert main(["plan", str(costs), "--cluster", "99999999999"]) == 1  # was a MemoryError
    err = capsys.readouterr().err
    assert err.startswith("pdcompile: error: a cluster of 99999999999 devices is above the cap")
    assert main(["plan", str(costs), "--cluster", "2@"]) == 1
    assert "cannot read cluster '2@'" in capsys.readouterr().err
