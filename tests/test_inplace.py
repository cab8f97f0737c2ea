"""In-place operations: capture rewrites them out of place (or falls back to torch.export), cost
passes price them, stages that write into what they receive work, and pipelines of models full
of `inplace=True` train like gradient accumulation, in one process and on two gloo ranks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pipeline_support import accumulate_reference
from spawn import run_ranks

import pdcompile
from pdcompile.core.cluster import Cluster
from pdcompile.graph.mutation import is_inplace
from pdcompile.passes.planning.plans import Plan, Stage
from pdcompile.runtime.distributed import init_process_group


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05)


class _EveryKind(nn.Module):
    """One of each in-place spelling fx records."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x), inplace=True)
        h = F.leaky_relu(h, 0.1, True)  # inplace by position
        g = self.act(self.b(h))
        g.mul_(0.5)
        torch.sigmoid_(g)
        g = g.add_(h)
        return self.c(g)


class _WritesIntoAView(nn.Module):
    """`h[:, :3] += 1` changes `h`, which is used afterwards: only export can keep that."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        view = h[:, :3]
        view.mul_(3.0)
        return self.b(h)


class _AssignsItems(nn.Module):
    """Item assignment, as Hugging Face models build masks (`mask[:, 0] = 1`, Longformer): into
    a fresh tensor, and of a computed value into an intermediate."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        mask = torch.zeros_like(h)
        mask[:, 0] = 1
        g = self.b(h * (1 + mask))
        g[:, 1:3] = h[:, :2] * 2
        return self.c(torch.relu(g))


class _InceptionStyle(nn.Module):
    """Branches of conv + BatchNorm + in-place ReLU, concatenated (torchvision's Inception)."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.ModuleList([nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4)])
        self.b3 = nn.ModuleList([nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4)])
        self.pool = nn.Conv2d(8, 4, 1)
        self.head = nn.Linear(12, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x), inplace=True)
        one = F.relu(self.b1[1](self.b1[0](x)), inplace=True)
        three = F.relu(self.b3[1](self.b3[0](x)), inplace=True)
        pooled = F.relu(self.pool(F.avg_pool2d(x, 3, stride=1, padding=1)), inplace=True)
        x = torch.cat([one, three, pooled], 1)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class _DenseStyle(nn.Module):
    """Dense layers (BatchNorm, `nn.ReLU(inplace=True)`, conv) on the concatenation of all
    earlier features (torchvision's DenseNet)."""

    def __init__(self, classes: int = 5, growth: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.BatchNorm2d(8 + i * growth),
                nn.ReLU(inplace=True),
                nn.Conv2d(8 + i * growth, growth, 3, padding=1),
            )  # fmt: skip
            for i in range(layers)
        )
        self.head = nn.Linear(8 + layers * growth, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        out = F.relu(torch.cat(features, 1), inplace=True)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


def _no_inplace_left(gm: torch.fx.GraphModule) -> bool:
    modules = dict(gm.named_modules())
    return not any(
        is_inplace(n, modules.get(n.target) if n.op == "call_module" else None)
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method", "call_module")
    )


def test_capture_rewrites_every_inplace_spelling_and_costs_run() -> None:
    torch.manual_seed(0)
    model, x = _EveryKind(), torch.randn(4, 8)
    gm = pdcompile.trace(model, (x,))
    assert gm.meta["pdcompile.capture"] == "fx" and _no_inplace_left(gm)
    assert model.act.inplace, "the user's module is left as it was"
    torch.testing.assert_close(gm(x), model(x))
    for profile in (False, True):
        costs = pdcompile.analyze(gm, (x,), profile=profile, cache=False, progress=False)
        assert costs.totals()["backward_s"] > 0


def test_item_assignment_is_traced_by_fx_and_trains_like_gradient_accumulation() -> None:
    """fx's Proxy had no `__setitem__`: `mask[:, 0] = 1` failed symbolic tracing outright."""
    torch.manual_seed(0)
    model, x, y = _AssignsItems(), torch.randn(8, 8), torch.randint(0, 3, (8,))
    gm = pdcompile.trace(model, (x,), method="fx")
    assert gm.meta["pdcompile.capture"] == "fx" and _no_inplace_left(gm)
    torch.testing.assert_close(gm(x), model(x))
    written = [n for n in gm.graph.nodes if n.name.startswith("setitem")]
    assert len(written) == 2 and "mask[:, 0] = 1" in written[0].meta["stack_trace"]
    pipe = pdcompile.compile(model, (x,), loss_fn=F.cross_entropy, optimizer=_sgd, cluster="2",
                             solver="uniform", profile=False, num_microbatches=2)  # fmt: skip
    assert pipe.plan.num_stages == 2
    losses = [pipe.train_step(x, y) for _ in range(3)]
    ref, ref_loss = accumulate_reference(model, x, y, F.cross_entropy, _sgd, 2, 3)
    assert losses[-1] == pytest.approx(ref_loss, rel=1e-5)
    for key, tensor in ref.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], tensor, msg=key)


def test_a_written_program_keeps_item_assignment_one_call(tmp_path) -> None:
    """The rewritten assignment (`assigned`) is one node; re-tracing the written source must not
    trace into it (its own `result[key] = value`)."""
    from pdcompile.graph.mutation import assigned

    torch.manual_seed(0)
    model, x = _AssignsItems(), torch.randn(8, 8)
    gm = pdcompile.trace(model, (x,), method="fx")
    costs = pdcompile.analyze(gm, (x,), profile=False, progress=False)
    program = pdcompile.codegen(gm, pdcompile.plan(costs, "2", solver="uniform"))
    program.write_source(tmp_path)
    loaded = pdcompile.StagedProgram.load(tmp_path, model)
    calls = [n for s in loaded.stages for n in s.graph.nodes if n.target is assigned]
    assert len(calls) == 2
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


def test_costs_of_a_graph_with_inplace_nodes_left_run() -> None:
    """A graph that still writes in place (a user's own fx graph) is priced on copies."""
    torch.manual_seed(0)
    model, x = _EveryKind(), torch.randn(4, 8)
    gm = pdcompile.trace(model, (x,))
    for node in gm.graph.nodes:  # put one in-place write back
        if node.op == "call_function" and node.target is F.relu:
            node.update_kwarg("inplace", True)
    gm.recompile()
    assert not _no_inplace_left(gm)
    costs = pdcompile.analyze(gm, (x,), profile=False, progress=False)
    relu = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.relu)
    assert costs.graph.nodes[relu.name]["backward_s"] > 0


def test_a_write_through_a_view_falls_back_to_export_and_fx_says_why() -> None:
    torch.manual_seed(0)
    model, x = _WritesIntoAView(), torch.randn(4, 8)
    shared = r"node mul_ writes into getitem in place, and relu, which shares its memory"
    with pytest.raises(pdcompile.TraceError, match=shared):
        pdcompile.trace(model, (x,), method="fx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = pdcompile.trace(model, (x,))
    assert gm.meta["pdcompile.capture"] == "export" and _no_inplace_left(gm)
    torch.testing.assert_close(gm(x), model(x))
    pdcompile.analyze(gm, (x,), profile=False, progress=False)


class _NormThenViewWrite(nn.Module):
    """BatchNorm layers, then a write through a view: capture needs export's functionalization."""

    def __init__(self) -> None:
        super().__init__()
        self.b1 = nn.ModuleList([nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)])
        self.b3 = nn.ModuleList([nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)])
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.b1[1](self.b1[0](x)))
        h = F.relu(self.b3[1](self.b3[0](h)))
        h[:, :2].mul_(0.5)
        return self.head(h.mean((2, 3)))


def test_export_keeps_batchnorm_updates_in_the_stage_that_computes_them() -> None:
    """Export's functionalization moves buffer updates to the graph's end; capture moves each
    back beside its value, so the stage holding the BatchNorm updates its statistics."""
    torch.manual_seed(0)
    model, x = _NormThenViewWrite().train(), torch.randn(4, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = pdcompile.trace(model, (x,), method="export")
    assert _no_inplace_left(gm) or all(
        n.args[0].op == "get_attr"
        for n in gm.graph.nodes
        if n.op == "call_function" and is_inplace(n)
    )
    costs = pdcompile.analyze(gm, (x,), profile=False, progress=False)
    program = pdcompile.codegen(gm, pdcompile.plan(costs, "2", solver="uniform"))
    assert any("scatter" in str(n.target) for n in gm.graph.nodes)  # functional ATen
    reference = _NormThenViewWrite().train()
    reference.load_state_dict(model.state_dict())
    torch.testing.assert_close(program(x), reference(x))
    state = {k: v for s in program.stages for k, v in s.state_dict().items()}
    for name in ("b1.1.running_mean", "b3.1.running_var", "b1.1.num_batches_tracked"):
        torch.testing.assert_close(state[name], reference.state_dict()[name], msg=name)


def test_a_stage_that_writes_into_what_it_receives_trains(monkeypatch) -> None:
    """Without capture's rewrite, stage 1 starts with `relu_` on the tensor it received (a
    leaf): code generation gives it a copy to write into."""
    import pdcompile.capture.tracing as tracing

    monkeypatch.setattr(tracing, "inplace_nodes", lambda gm: [])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    gm = pdcompile.trace(model, (x,))
    names = [n.name for n in gm.graph.nodes if n.op == "call_module"]
    assert names == ["_0", "_1", "_2"] and not _no_inplace_left(gm)
    plan = Plan(
        stages=(Stage(0, ("input_1", "_0"), 1, (0,)), Stage(1, ("_1", "_2", "output"), 1, (1,))),
        cluster=Cluster.parse("2"),
    )
    program = pdcompile.codegen(gm, plan)
    assert "clone" in program.stages[1].code
    pipe = pdcompile.compile(
        model, (x,), loss_fn=F.cross_entropy, optimizer=_sgd, plan=plan, profile=False,
        num_microbatches=2,
    )  # fmt: skip
    losses = [pipe.train_step(x, y) for _ in range(3)]
    ref, ref_loss = accumulate_reference(model, x, y, F.cross_entropy, _sgd, 2, 3)
    assert losses[-1] == pytest.approx(ref_loss, rel=1e-5)


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    return MixtralForCausalLM(config).train()


def _lm_loss(out, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def _cases() -> dict:
    """name -> (model, inputs, targets, loss_fn), each seeded."""
    torch.manual_seed(0)
    images, labels = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(1))
    return {
        "inception": (_InceptionStyle().train(), images, labels, F.cross_entropy),
        "densenet": (_DenseStyle().train(), images, labels, F.cross_entropy),
        "mixtral": (_mixtral(), ids, torch.roll(ids, -1, 1), _lm_loss),
    }


def _train_all(rank: int, world_size: int, init_file: str) -> dict:
    warnings.simplefilter("ignore")
    init_process_group(rank, world_size, init_file=init_file, timeout_s=180)
    results = {}
    for name, (model, x, y, loss_fn) in _cases().items():
        pipe = pdcompile.compile(
            model, (x,), loss_fn=loss_fn, optimizer=_sgd, solver="uniform", profile=False,
            schedule="1f1b",
        )  # fmt: skip
        losses = [pipe.train_step(x, y) for _ in range(3)]
        results[name] = {
            "losses": losses, "state": pipe.state_dict(), "m": pipe.pipeline.num_microbatches,
            "capture": pipe.pipeline.program.plan.num_stages,
        }  # fmt: skip
    dist.destroy_process_group()
    return results


def test_inplace_models_on_two_ranks_train_like_gradient_accumulation() -> None:
    per_rank = run_ranks(_train_all, 2, timeout_s=280)
    for name, (model, x, y, loss_fn) in _cases().items():
        result = per_rank[0][name]
        assert result["capture"] == 2
        ref, ref_loss = accumulate_reference(model, x, y, loss_fn, _sgd, result["m"], 3)
        for r in per_rank:
            assert r[name]["losses"][-1] == pytest.approx(ref_loss, rel=1e-5), name
        state = {**per_rank[0][name]["state"], **per_rank[1][name]["state"]}
        for key, tensor in ref.state_dict().items():
            torch.testing.assert_close(state[key], tensor, msg=f"{name}: {key}")


class _Once(nn.Module):
    """A leaf that, once armed, refuses to run: the cost passes, which re-run it, name it."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("ran again")
        return x * 2


def test_a_failing_cost_pass_names_the_node_and_the_way_out() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _Once(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    gm = pdcompile.trace(model, (x,), leaf_modules=[_Once])
    model[1].armed = True
    with pytest.raises(pdcompile.CostError) as info:
        pdcompile.analyze(gm, (x,), profile=False, progress=False)
    message = str(info.value)
    assert "at node _1 (_Once): RuntimeError: ran again" in message
    assert "leaf module '1' must compute the same way on every call" in message
