"""Everything a step does is priced: the loss function (CostGraph `loss_forward_s` /
`loss_backward_s`, on the stage holding the output) and the optimizer step (node `optimizer_s`),
in the CostGraph, its JSON, the solvers, `evaluate`, the simulator and plan files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import pdcompile
from pdcompile.core.cluster import Cluster, RuntimeCosts
from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import CostError, PartitionError
from pdcompile.passes import step_costs
from pdcompile.passes.coarsening import coarsen
from pdcompile.passes.device_model import DeviceModel
from pdcompile.passes.memory import STEP_BYTES
from pdcompile.passes.planning.action_costs import stage_costs
from pdcompile.passes.planning.plans import Plan, Stage
from pdcompile.passes.step_costs import describe_optimizer


def chain(
    loss_s: float = 0.0, optimizer_s: float = 0.0, n: int = 4, param_bytes: int = 100
) -> CostGraph:
    """x -> n0 .. n{n-1} -> out: equal nodes of 1 s forward and 2 s backward, `param_bytes`
    each; the loss split 1:2 like the nodes."""
    g = CostGraph(
        batch_size=8, meta={"source": "test"}, loss_forward_s=loss_s / 3,
        loss_backward_s=2 * loss_s / 3, optimizer="sgd" if optimizer_s else "",
    )  # fmt: skip
    g.add_node("x", kind="input", output_bytes=64)
    previous = "x"
    for i in range(n):
        g.add_node(
            f"n{i}", forward_s=1.0, backward_s=2.0, param_bytes=param_bytes,
            grad_bytes=param_bytes, activation_bytes=64, output_bytes=64, optimizer_s=optimizer_s,
            forward_spread=0.1 * i, backward_spread=0.05,
        )  # fmt: skip
        g.add_edge(previous, f"n{i}", 64)
        previous = f"n{i}"
    g.add_node("out", kind="output")
    g.add_edge(previous, "out", 64)
    return g


# -- the CostGraph ---------------------------------------------------------------------------


def test_new_attributes_default_to_zero_and_are_checked() -> None:
    g = CostGraph(batch_size=2)
    g.add_node("a", forward_s=1.0)
    data = g.graph.nodes["a"]
    assert (data["optimizer_s"], data["forward_spread"], data["backward_spread"]) == (0, 0, 0)
    assert (g.loss_forward_s, g.loss_backward_s, g.loss_s, g.optimizer) == (0.0, 0.0, 0.0, "")
    with pytest.raises(CostError, match="'optimizer_s' must be a finite number >= 0"):
        g.add_node("b", optimizer_s=-1.0)
    with pytest.raises(CostError, match="loss_forward_s must be a finite number of seconds"):
        CostGraph(loss_forward_s=float("nan"))
    with pytest.raises(CostError, match="optimizer must be a string"):
        CostGraph(optimizer=None)  # type: ignore[arg-type]
    g.loss_backward_s = -1.0
    with pytest.raises(CostError, match="loss_backward_s must be a finite number"):
        g.validate()


def test_loss_node_and_compute_times() -> None:
    g = chain(loss_s=3.0)
    assert g.loss_s == pytest.approx(3.0) and g.loss_node == "out"
    assert g.compute_times() == [0.0, 3.0, 3.0, 3.0, 3.0, pytest.approx(3.0)]
    assert g.compute_times(["n1", "out"]) == [3.0, pytest.approx(3.0)]
    bare = CostGraph()
    assert bare.loss_node is None
    bare.add_node("a", forward_s=1.0)
    bare.add_node("b", forward_s=1.0)
    assert bare.loss_node == "b"  # no output node: the last node


def test_scaling_scales_the_loss_not_the_step_nor_the_spread() -> None:
    g = chain(loss_s=3.0, optimizer_s=0.5)
    half = g.scaled(4)
    assert half.loss_forward_s == g.loss_forward_s / 2
    assert half.loss_backward_s == g.loss_backward_s / 2
    assert half.optimizer == "sgd"
    for node in g.nodes:
        for name in ("optimizer_s", "forward_spread", "backward_spread"):
            assert half.graph.nodes[node][name] == g.graph.nodes[node][name]
    assert half.graph.nodes["n1"]["forward_s"] == 0.5
    assert g.copy() == g and g.copy().loss_s == g.loss_s
    assert g != chain(loss_s=1.0, optimizer_s=0.5)


def test_coarsening_keeps_the_loss_sums_the_step_and_weighs_the_spread() -> None:
    g = chain(loss_s=3.0, optimizer_s=0.5)
    layers = coarsen(g, 3)
    assert layers.step_costs() == g.step_costs()
    assert layers.totals()["optimizer_s"] == g.totals()["optimizer_s"] == 2.0
    assert math_close(sum(layers.compute_times()), sum(g.compute_times()))
    for _, layer in layers.graph.nodes(data=True):
        members = [g.graph.nodes[m] for m in layer["members"]]
        time = sum(m["forward_s"] for m in members)
        if time:
            expected = sum(m["forward_spread"] * m["forward_s"] for m in members) / time
            assert layer["forward_spread"] == pytest.approx(expected)


def math_close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 * max(1.0, abs(a), abs(b))


def test_json_round_trip_and_older_files_load_with_zeros() -> None:
    g = chain(loss_s=3.0, optimizer_s=0.5)
    text = g.to_json()
    doc = json.loads(text)
    assert doc["version"] == 4 and doc["optimizer"] == "sgd"
    assert (doc["loss_forward_s"], doc["loss_backward_s"]) == (1.0, 2.0)
    assert doc["nodes"][1]["optimizer_s"] == 0.5 and doc["nodes"][2]["forward_spread"] == 0.1
    back = CostGraph.from_json(text)
    assert back == g and back.to_json() == text
    old = json.loads(text)
    old["version"] = 2
    for name in ("loss_forward_s", "loss_backward_s", "optimizer", "rows", "loss_row_s"):
        del old[name]
    for record in old["nodes"]:
        for name in ("optimizer_s", "forward_spread", "backward_spread", "row_s",
                     "accumulate_s"):  # fmt: skip
            del record[name]
    back = CostGraph.from_json(json.dumps(old))
    assert (back.loss_s, back.optimizer) == (0.0, "")
    assert all(back.graph.nodes[n]["optimizer_s"] == 0.0 for n in back.nodes)
    assert all(back.graph.nodes[n]["forward_spread"] == 0.0 for n in back.nodes)
    with pytest.raises(CostError, match=r"unknown \['loss_backward_s', 'loss_forward_s'"):
        CostGraph.from_json(json.dumps({**old, "loss_forward_s": 0.0, "loss_backward_s": 0.0}))
    del doc["optimizer"]
    with pytest.raises(CostError, match=r"missing \['optimizer'\]"):
        CostGraph.from_json(json.dumps(doc))


def test_str_shows_the_loss_and_the_step_when_priced() -> None:
    text = str(chain(loss_s=3.0, optimizer_s=0.5))
    assert "loss per batch: forward 1.00 s, backward 2.00 s; optimizer step: 2.00 s (sgd)" in text
    assert "loss per batch" not in str(chain())


# -- the solvers, evaluate, the simulator ----------------------------------------------------


def one_stage(costs: CostGraph, num_microbatches: int = 4, schedule: str = "1f1b") -> Plan:
    stage = Stage(index=0, nodes=tuple(costs.nodes), replicas=1, ranks=(0,))
    plan = Plan(stages=(stage,), cluster="1", schedule=schedule, num_microbatches=num_microbatches)
    return pdcompile.evaluate(plan, costs)


def test_the_last_stage_pays_the_loss_in_its_forward_and_backward() -> None:
    plain = pdcompile.evaluate(
        pdcompile.plan(chain(), "2", num_microbatches=4, replica_counts=(1,)), chain()
    )
    lossy = pdcompile.evaluate(plain, chain(loss_s=3.0))
    first, last = lossy.stages
    assert (first.loss_s, last.loss_s) == (0.0, pytest.approx(3.0))
    assert last.forward_s == pytest.approx(plain.stages[1].forward_s + 1.0)
    assert last.backward_s == pytest.approx(plain.stages[1].backward_s + 2.0)
    assert last.backward_input_s == pytest.approx(plain.stages[1].backward_input_s + 2.0)
    assert last.backward_weight_s == plain.stages[1].backward_weight_s  # the loss has no weights
    assert last.time_s == pytest.approx(plain.stages[1].time_s + 3.0)
    assert first == plain.stages[0]
    assert lossy.lower_bound == pytest.approx(plain.lower_bound + 3.0 / 2)
    assert plain.unpriced == ("loss", "optimizer") and lossy.unpriced == ("optimizer",)
    assert "not priced: the loss function" in str(plain)
    assert "loss 3.00 s/minibatch on stage 1" in str(lossy)


@pytest.mark.parametrize("solver", ["dp", "ideal", "cpsat"])
def test_solvers_leave_the_last_stage_lighter_for_a_heavy_loss(solver: str) -> None:
    options = {"solver": solver, "num_microbatches": 4, "replica_counts": (1,)}
    plain = pdcompile.plan(chain(n=8), "2", **options)
    lossy = pdcompile.plan(chain(loss_s=9.0, n=8), "2", **options)
    assert len(plain.stages[-1].nodes) == 5  # n4..n7 and out: 4 of the 8 nodes
    assert len(lossy.stages[-1].nodes) < len(plain.stages[-1].nodes)
    # 8 nodes of 3 s and a loss of 9 s: 5 and 3 nodes (15 s against 9 + 9 s) is a best split
    assert lossy.predicted_time == pytest.approx(18.0)


def test_dp_bisection_leaves_the_last_stage_lighter_for_a_heavy_loss() -> None:
    # slow links and large gradients: replicas would cost more than they save, so the fast
    # path (bisection on a flat cluster without memory limit) cuts a two-stage pipeline
    plain = pdcompile.plan(chain(n=8, param_bytes=10_000), "2@1KB/s", num_microbatches=4)
    lossy = pdcompile.plan(
        chain(loss_s=9.0, n=8, param_bytes=10_000), "2@1KB/s", num_microbatches=4
    )
    assert [s.replicas for s in lossy.stages] == [1, 1]
    assert len(lossy.stages[-1].nodes) < len(plain.stages[-1].nodes)
    assert lossy.predicted_time == pytest.approx(18.0)


def test_the_simulated_step_grows_by_m_losses_and_one_optimizer_step() -> None:
    m = 4
    base = one_stage(chain(), m)
    lossy = one_stage(chain(loss_s=3.0), m)
    stepped = one_stage(chain(loss_s=3.0, optimizer_s=0.5), m)
    assert lossy.step_time == pytest.approx(base.step_time + m * 3.0)
    assert stepped.step_time == pytest.approx(lossy.step_time + 4 * 0.5)  # 4 nodes' steps
    assert pdcompile.simulate(stepped).time_per_step == stepped.step_time
    (stage,) = stepped.stages
    assert stage.optimizer_s == 2.0 and stage.time_s == pytest.approx(
        lossy.stages[0].time_s + 2 / m
    )
    # pipedream updates after every microbatch: m steps per train_step call
    streaming = one_stage(chain(optimizer_s=0.5), m, "pipedream")
    without = one_stage(chain(), m, "pipedream")
    assert streaming.step_time == pytest.approx(without.step_time + m * 2.0)
    assert streaming.stages[0].time_s == pytest.approx(without.stages[0].time_s + 2.0)


def test_a_stage_pays_the_optimizers_call_once_per_update() -> None:
    costs = chain(optimizer_s=0.5)
    costs.meta = {**costs.meta, "optimizer_call_s": 0.25}
    plan = pdcompile.evaluate(pdcompile.plan(chain(), "2", replica_counts=(1,)), costs)
    assert [s.optimizer_s for s in plan.stages] == [1.25, 1.25]  # 2 nodes' steps + one call
    assert one_stage(costs).stages[0].optimizer_s == 2.25
    assert one_stage(costs).step_time == pytest.approx(one_stage(chain()).step_time + 2.25)
    costs.meta["optimizer_call_s"] = -1
    with pytest.raises(PartitionError, match="optimizer_call_s=-1; it must be seconds >= 0"):
        one_stage(costs)


def test_the_measured_step_replaces_the_memory_traffic_estimate() -> None:
    cluster = Cluster([(1, 1e9)], runtime=RuntimeCosts(memory_bandwidth=1e6, tensor_s=1e-3))
    estimated = pdcompile.evaluate(one_stage(chain()), chain(), cluster=cluster)
    measured = pdcompile.evaluate(one_stage(chain()), chain(optimizer_s=0.5), cluster=cluster)
    costs = {
        name: stage_costs(plan, cluster)[0].step_s
        for name, plan in (("estimated", estimated), ("measured", measured))
    }
    assert costs["estimated"] > 0 and costs["measured"] == 2.0
    assert measured.step_time == pytest.approx(estimated.step_time - costs["estimated"] + 2.0)


def test_rescore_scales_the_loss_not_the_optimizer_step() -> None:
    plan = pdcompile.evaluate(
        pdcompile.plan(chain(), "2", num_microbatches=4, replica_counts=(1,)),
        chain(loss_s=3.0, optimizer_s=0.5),
    )
    plan = plan.with_(microbatch_size=8)
    double = pdcompile.passes.planning.evaluation.rescore(
        plan, microbatch_size=16, num_microbatches=8
    )
    again = pdcompile.evaluate(plan, chain(loss_s=3.0, optimizer_s=0.5).scaled(16), None, None, 8)
    for mine, truth in zip(double.stages, again.stages, strict=True):
        assert mine.loss_s == pytest.approx(truth.loss_s)
        assert mine.optimizer_s == truth.optimizer_s == 1.0
        assert mine.time_s == pytest.approx(truth.time_s)
    assert double.step_time == pytest.approx(again.step_time)


def test_plan_json_round_trip_and_older_plans_load_with_zeros(tmp_path: Path) -> None:
    plan = pdcompile.evaluate(
        pdcompile.plan(chain(), "2", num_microbatches=4, replica_counts=(1,)),
        chain(loss_s=3.0, optimizer_s=0.5),
    )
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.stages[1].loss_s == pytest.approx(3.0)
    assert back.unpriced == ()
    doc = json.loads(plan.to_json())
    del doc["unpriced"]
    for stage in doc["stages"]:
        del stage["loss_s"], stage["optimizer_s"]
    old = Plan.from_dict(doc)
    assert all(s.loss_s == s.optimizer_s == 0.0 for s in old.stages) and old.unpriced == ()


# -- analyze: the loss and the optimizer step measured and modelled --------------------------


class TokenHead(nn.Module):
    """Tokens -> an embedding, a small body, and a head onto `vocab` classes: with
    cross-entropy, the loss is the heaviest single operation of a step."""

    def __init__(self, vocab: int = 16384, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, vocab]
        return self.head(torch.relu(self.body(self.embed(tokens))))


def token_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), targets.flatten())


def token_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return TokenHead(), torch.randint(0, 16384, (4, 8)), torch.randint(0, 16384, (4, 8))


class _Operations(TorchDispatchMode):
    """Counts the ATen operations run inside it (autograd's backward included) and the bytes
    of their tensor arguments and results."""

    def __init__(self) -> None:
        super().__init__()
        self.count = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.count += 1
        tensors = [*args, *(kwargs or {}).values(), *(out if isinstance(out, tuple) else [out])]
        self.bytes += sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
        return out


def operation_clock(device: torch.device):
    """A timer reading 1 ms per ATen operation the timed call runs: timings that do not depend
    on this machine's load."""

    def timed(fn) -> float:  # noqa: ANN001
        with _Operations() as ops:
            fn()
        return ops.count * 1e-3

    return timed


def bytes_clock(device: torch.device):
    """A timer reading 1 ns per byte the timed call's ATen operations read and write."""

    def timed(fn) -> float:  # noqa: ANN001
        with _Operations() as ops:
            fn()
        return ops.bytes * 1e-9

    return timed


def test_analyze_times_a_heavy_loss_near_what_it_takes_directly(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(step_costs, "device_timer", operation_clock)
    model, x, y = token_case()
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), loss_fn=token_loss, targets=y, cache=tmp_path,
                              progress=False, calibration=False)  # fmt: skip
    assert costs.loss_forward_s > 0 and costs.loss_backward_s > 0
    out = model(x).detach().requires_grad_()
    direct = operation_clock(torch.device("cpu"))(lambda: token_loss(out, y).backward())
    ratio = costs.loss_s / direct
    assert 0.1 < ratio < 10, ratio  # the same work on the same clock (less one grad call)
    assert costs.optimizer == "sgd" and costs.loss_node == "output"
    assert pdcompile.analyze(gm, (x,), profile=False, calibration=False).loss_s == 0.0


# the loss takes targets of the example's rows only: other row counts are left out (and said)
@pytest.mark.filterwarnings("ignore:costs at 1 rows per microbatch were not measured")
def test_analytic_loss_is_its_flops_and_bytes_on_the_device_model() -> None:
    model, x, _ = token_case()
    gm = pdcompile.trace(model, (x,))
    columns = torch.ones(16384, 3)
    compute_bound = DeviceModel(peak_flops=1e9, memory_bandwidth=1e30, name="flops")
    costs = pdcompile.analyze(
        gm, (x,), profile=False, device_model=compute_bound, calibration=False,
        loss_fn=lambda out, t: (out.flatten(0, 1) @ t).sum(), targets=columns,
    )  # fmt: skip
    rows = 4 * 8
    assert costs.loss_forward_s == pytest.approx(2 * rows * 16384 * 3 / 1e9)  # the matmul
    assert costs.loss_backward_s == pytest.approx(2 * rows * 16384 * 3 / 1e9)  # its input grad
    memory_bound = DeviceModel(peak_flops=1e30, memory_bandwidth=1e9, name="bytes")
    targets = torch.zeros(4, 8, dtype=torch.long)
    ce = pdcompile.analyze(gm, (x,), profile=False, device_model=memory_bound, calibration=False,
                           loss_fn=token_loss, targets=targets)  # fmt: skip
    logits = rows * 16384 * 4
    assert ce.loss_forward_s >= 2 * logits / 1e9  # reads the logits, writes log-softmax


def test_optimizer_step_per_node_modelled_exactly_and_timed_by_size(
    tmp_path: Path, monkeypatch
) -> None:
    model, x, _ = token_case()
    gm = pdcompile.trace(model, (x,))
    device = DeviceModel(peak_flops=1e12, memory_bandwidth=1e9, overhead_s=1e-6, name="d")
    for name, state in (("sgd", 0), ("adam", 2)):
        costs = pdcompile.analyze(gm, (x,), profile=False, device_model=device, optimizer=name,
                                  calibration=False)  # fmt: skip
        assert costs.optimizer == name
        for node in costs.nodes:
            data = costs.graph.nodes[node]
            tensors = {"embed": 1, "body": 2, "head": 2}.get(node, 0)
            expected = tensors * 1e-6 + (3 + 2 * state) * data["param_bytes"] / 1e9
            assert data["optimizer_s"] == pytest.approx(expected), node
    monkeypatch.setattr(step_costs, "device_timer", bytes_clock)  # not this machine's load
    timed = pdcompile.analyze(gm, (x,), optimizer="adam", cache=tmp_path, progress=False,
                              calibration=False)  # fmt: skip
    step = {n: timed.graph.nodes[n]["optimizer_s"] for n in ("embed", "body", "head")}
    # 1 MiB of weights against 1 KiB: the step follows the bytes
    assert step["embed"] > step["body"] and step["head"] > step["body"]
    assert timed.meta["optimizer_call_s"] >= 0.0 and costs.meta["optimizer_call_s"] == 0.0
    again = pdcompile.analyze(gm, (x,), optimizer="adam", cache=tmp_path, progress=False,
                              calibration=False)  # fmt: skip
    assert all(again.graph.nodes[n]["optimizer_s"] == s for n, s in step.items())  # cached


def test_a_factory_is_named_sized_and_timed() -> None:
    adamw = describe_optimizer(lambda p: torch.optim.AdamW(p, lr=3e-4, weight_decay=0.1))
    assert adamw.name.startswith("AdamW(lr=0.0003, betas=(0.9, 0.999)") and adamw.kind == "adam"
    momentum = describe_optimizer(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert momentum.kind == "momentum" and describe_optimizer("sgd").kind == "sgd"
    with pytest.raises(CostError, match="optimizer must be one of"):
        describe_optimizer("lion")
    model, x, _ = token_case()
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False, calibration=False,
                              optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4))  # fmt: skip
    head = costs.graph.nodes["head"]
    tensors = len(list(model.head.parameters()))  # Adam's step count: one per tensor
    assert head["optimizer_bytes"] == 2 * head["grad_bytes"] + STEP_BYTES["adam"] * tensors
    assert costs.optimizer.startswith("AdamW")


def test_compile_prices_the_loss_given_example_targets_and_says_when_not() -> None:
    model, x, y = token_case()
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    pipe = pdcompile.compile(model, (x,), loss_fn=token_loss, optimizer=sgd, cluster="2",
                             solver="uniform", profile=False, example_targets=y)  # fmt: skip
    assert pipe.plan.stages[-1].loss_s > 0 and pipe.plan.unpriced == ()
    assert "not priced" not in pipe.explain()
    pipe.train_step(x, y)
    blind = pdcompile.compile(model, (x,), loss_fn=token_loss, optimizer=sgd, cluster="2",
                              solver="uniform", profile=False)  # fmt: skip
    assert blind.plan.stages[-1].loss_s == 0.0
    assert "not priced: the loss function" in blind.explain()
