"""Code generation rejects bad plans and values that cannot cross a stage, naming the nodes."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn as nn
from support import captured, flat

import pdcompile
from pdcompile import Cluster, CodegenError, Plan, Stage


def plan_of(groups: Sequence[Sequence[str]]) -> Plan:
    stages = tuple(
        Stage(index=i, nodes=tuple(nodes), replicas=1, ranks=(i,)) for i, nodes in enumerate(groups)
    )
    return Plan(stages=stages, cluster=Cluster.parse(str(len(groups))))


def mlp_nodes() -> tuple[torch.fx.GraphModule, list[str]]:
    _, gm, _, _ = captured("mlp")
    return gm, [n.name for n in gm.graph.nodes]


def test_unknown_missing_and_repeated_nodes_are_named() -> None:
    gm, names = mlp_nodes()
    with pytest.raises(CodegenError, match=r"not in the graph of MLP: nope; .*cost_graph="):
        pdcompile.codegen(gm, plan_of([names[:4], [*names[4:], "nope"]]))
    with pytest.raises(CodegenError, match=r"in no stage: net_3"):
        pdcompile.codegen(gm, plan_of([names[:4], [n for n in names[4:] if n != "net_3"]]))
    with pytest.raises(CodegenError, match=r"several stages: net_2 \(stages 0, 1\)"):
        pdcompile.codegen(gm, plan_of([names[:4], ["net_2", *names[4:]]]))
    shuffled = Plan(stages=(Stage(1, tuple(names), 1, (0,)),), cluster=Cluster.parse("1"))
    with pytest.raises(CodegenError, match="stage 0 has index 1"):
        pdcompile.codegen(gm, shuffled)


def test_non_convex_stage_is_named_with_the_path_out_and_back() -> None:
    gm, names = mlp_nodes()
    first = [n for n in names[:6] if n != "net_2"]  # net_1 -> net_2 -> net_3 leaves stage 0
    with pytest.raises(CodegenError, match=r"stage 0 is not convex.*net_2 \(stage 1\)"):
        pdcompile.codegen(gm, plan_of([first, ["net_2", *names[6:]]]))


class Independent(nn.Module):
    """Three independent chains; the output needs only the first."""

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        a = x.sin()
        a.cos()
        y.sin().cos()
        z.sin().cos()
        return a


def test_cycle_of_convex_stages_and_stages_out_of_order_are_rejected() -> None:
    xs = (torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3))
    gm = pdcompile.trace(Independent(), xs)
    order = [n.name for n in gm.graph.nodes]
    # canonical order: the inputs, the chains nothing uses (y's, z's), then the output's (x's)
    assert order == ["x", "y", "z", "sin", "cos", "sin_1", "cos_1", "sin_2", "cos_2", "output"]
    assert [n.args[0].name for n in gm.graph.nodes if n.name.startswith("sin")] == ["y", "z", "x"]
    # 0 -> 1 (sin_2 -> cos_2), 1 -> 2 (sin -> cos), 2 -> 0 (sin_1 -> cos_1): each stage convex
    cyclic = [["x", "y", "sin_2", "cos_1"], ["cos_2", "sin"], ["z", "cos", "sin_1", "output"]]
    with pytest.raises(
        CodegenError, match=r"cycle: stage 0 -> 1 .*stage 2 -> 0 \(sin_1 -> cos_1\)"
    ):
        pdcompile.codegen(gm, plan_of(cyclic))
    with pytest.raises(CodegenError, match=r"stage 1 feeds the earlier stage 0 \(node y -> sin\)"):
        pdcompile.codegen(gm, plan_of([order[3:], order[:3]]))


def test_plans_are_checked_before_the_graph_is_run(monkeypatch) -> None:
    def fail(gm):
        raise AssertionError("code generation started")

    import pdcompile.lowering.stage_codegen as stage_codegen

    monkeypatch.setattr(stage_codegen, "describe_values", fail)
    gm, names = mlp_nodes()
    with pytest.raises(CodegenError, match="not convex"):
        pdcompile.codegen(gm, plan_of([[n for n in names if n != "net_2"], ["net_2"]]))


def test_coarsened_plans_need_their_cost_graph() -> None:
    _, gm, bound, _ = captured("gpt")
    args, kwargs = bound.call(bound.tensors)
    coarse = pdcompile.analyze(gm, args, example_kwargs=kwargs, profile=False, coarsen=6)
    plan = pdcompile.plan(coarse, Cluster.parse("3"), solver="uniform")
    with pytest.raises(CodegenError, match=r"L00\d.*pass cost_graph="):
        pdcompile.codegen(gm, plan)
    program = pdcompile.codegen(gm, plan, cost_graph=coarse)
    assert program.num_stages == plan.num_stages
    with torch.no_grad():
        for a, e in zip(flat(program(**bound.tensors)), flat(gm(**bound.tensors)), strict=True):
            assert torch.allclose(a, e)


class SplitThenCat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(self.fc(x), 2, dim=1)
        return torch.cat(parts, dim=1)


def test_a_tuple_of_tensors_crossing_a_boundary_is_named() -> None:
    gm = pdcompile.trace(SplitThenCat(), (torch.randn(3, 4),))
    names = [n.name for n in gm.graph.nodes]
    cut = names.index("cat")
    with pytest.raises(CodegenError, match=r"node split \(stage 0\) makes a tuple holding tensors"
                                           r", which node cat in stage 1"):  # fmt: skip
        pdcompile.codegen(gm, plan_of([names[:cut], names[cut:]]))
    pdcompile.codegen(gm, plan_of([names[: cut - 1], names[cut - 1 :]]))  # one stage: fine


class WritesInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        y = h * 2
        h.add_(1)
        return y + h


def test_in_place_write_seen_by_other_stages_is_rejected(monkeypatch) -> None:
    """Capture rewrites such writes out of place (then any cut works); a graph that still has
    one (here: capture's rewrite switched off) is refused where stages would disagree."""
    model, x = WritesInPlace().eval(), torch.randn(3, 4)
    gm = pdcompile.trace(model, (x,))
    names = [n.name for n in gm.graph.nodes]
    cut = names.index("add_")
    with torch.no_grad():
        assert torch.allclose(
            pdcompile.codegen(gm, plan_of([names[:cut], names[cut:]]))(x), model(x)
        )

    import pdcompile.capture.tracing as tracing

    monkeypatch.setattr(tracing, "inplace_nodes", lambda gm: [])
    gm = pdcompile.trace(model, (x,))
    with pytest.raises(CodegenError, match=r"add_ \(stage 1\) writes into fc in place.*\[0, 1\]"):
        pdcompile.codegen(gm, plan_of([names[:cut], names[cut:]]))
    fine = pdcompile.codegen(gm, plan_of([names[: cut - 1], names[cut - 1 :]]))
    with torch.no_grad():
        assert torch.allclose(fine(x), model(x))


class FixedBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.view(4, 6))


def test_a_model_that_fixes_the_batch_size_is_named() -> None:
    gm = pdcompile.trace(FixedBatch(), (torch.randn(4, 2, 3),))
    names = [n.name for n in gm.graph.nodes]
    with pytest.raises(CodegenError, match=r"node view fails when the graph runs at batch size 5"):
        pdcompile.codegen(gm, plan_of([names[:2], names[2:]]))
