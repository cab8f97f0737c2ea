"""The memory model checked against what the run holds (`runtime/memory_probe.py`).

Single-process tier: the probe counts exactly what autograd saves (each storage once, parameters
and weight copies not, views of the batch at their own bytes), releases it when the backward (or
W) frees it, and reads parameters, gradients, optimizer state and weight versions from the live
objects; `explain()` shows the measurement against the plan; a wrong model fails the comparison.
Multi-process tier: 2 spawned gloo ranks train the MLP, the residual CNN and the GPT (dropout
off, tied embedding) under `1f1b`, `gpipe`, `pipedream`, `2bw` and `zb-h1`, without and with
recomputation (every stage whole; segments by the √n rule under `1f1b` and `gpipe`), 36
configurations in one group, and each rank's measured peak must be within 10% of the simulated
one (`Plan.rank_memory[rank]` without what a recomputing backward holds inside it, which the
parts do not see on the CPU: docs/memory.md).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from spawn import run_ranks

import pdcompile
from pdcompile import zoo
from pdcompile.compiling.pipelined_module import PipelinedModule
from pdcompile.core.text import human_bytes
from pdcompile.passes.planning.evaluation import simulated
from pdcompile.passes.planning.recompute_choice import segment_boundaries, with_recompute
from pdcompile.runtime import memory_probe
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline
from pdcompile.runtime.local import LocalPipeline

M = 4  # microbatches per step
STEPS = 4  # enough calls for pipedream and 2bw to reach their steady state
TOLERANCE = 0.10
SCHEDULES = ["1f1b", "gpipe", "pipedream", "2bw", "zb-h1"]


def momentum(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def mlp_case() -> tuple:
    """(model, one microbatch's inputs and targets, loss, optimizer): activations about a
    third of a rank's memory."""
    torch.manual_seed(0)
    model = zoo.MLP(p=0.0).train()
    return model, torch.randn(32, 32), torch.randint(0, 10, (32,)), F.cross_entropy, momentum


def resnet_case() -> tuple:
    """BatchNorm buffers, convolutions, residual adds; activations dominate."""
    torch.manual_seed(0)
    model = zoo.ResNet(width=8).train()
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    return model, x, y, F.cross_entropy, adam


def gpt_case() -> tuple:
    """A tied embedding (a copy on each end), attention, and a loss the size of the logits."""
    torch.manual_seed(0)
    model = zoo.GPT(zoo.GPTConfig(dropout=0.0, n_layer=2)).train()
    x, y = torch.randint(0, 128, (4, 16)), torch.randint(0, 128, (4, 16))
    return model, x, y, token_loss, momentum


CASES = {"mlp": mlp_case, "resnet": resnet_case, "gpt": gpt_case}
# recomputation: none, every stage whole, every stage in segments (the √n rule); segments on
# two of the schedules only, for the default tier's time
RECOMPUTE = ["none", "whole", "segments"]
SEGMENTED = SCHEDULES[:2]
CONFIGS = [
    (case, kind, how)
    for case in CASES
    for kind in SCHEDULES
    for how in RECOMPUTE
    if how != "segments" or kind in SEGMENTED
]


@functools.cache
def _costs(case: str) -> tuple:
    """The traced graph and its analytic costs, with the loss (deterministic: every rank gets
    the same)."""
    model, x, y, loss_fn, optimizer = CASES[case]()
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False, optimizer=optimizer, loss_fn=loss_fn,
                              targets=y, cache=False, progress=False)  # fmt: skip
    return gm, costs


def _program(case: str, kind: str, how: str = "none") -> pdcompile.StagedProgram:
    """The case cut into 2 stages (one per rank) under `kind`, as `plan` scores it, each stage
    recomputing as `how` says."""
    gm, costs = _costs(case)
    plan = pdcompile.plan(costs, 2, schedule=kind, num_microbatches=M, replica_counts=[1],
                          recompute=False)  # fmt: skip
    assert [s.ranks for s in plan.stages] == [(0,), (1,)], plan
    if how != "none":
        forms = [True if how == "whole" else segment_boundaries(costs, s.nodes)
                 for s in plan.stages]  # fmt: skip
        assert all(forms), forms
        plan = with_recompute(plan, costs, forms)
    return pdcompile.codegen(gm, plan)


def _batch(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    _, x, y, _, _ = CASES[case]()
    return torch.cat([x] * M), torch.cat([y] * M)


def _check(case: str, kind: str, plan: pdcompile.Plan, measured: dict) -> None:
    for rank, c in memory_probe.compare(plan, measured).items():
        assert abs(c.error) <= TOLERANCE, f"{case} {kind} rank {rank}: {c.describe()}"


def _local(case: str, kind: str, measure: bool = True) -> PipelinedModule:
    """`STEPS` steps on the local executor (all ranks in this process)."""
    _, _, _, loss_fn, optimizer = CASES[case]()
    pipeline = LocalPipeline(_program(case, kind), schedule=kind, num_microbatches=M,
                             loss_fn=loss_fn, optimizer=optimizer)  # fmt: skip
    module = PipelinedModule(pipeline, rank=0)
    x, y = _batch(case)
    module.measure_memory(measure)
    for _ in range(STEPS):
        module.train_step(x, y)
    return module


@functools.cache
def trained_mlp() -> PipelinedModule:
    """The MLP under 1f1b, measured (shared by tests that only read it)."""
    return _local("mlp", "1f1b")


# -- single process: the probe itself -------------------------------------------------------


def saved_bytes(fn, *args) -> int:  # noqa: ANN001
    """Bytes of the distinct storages autograd saves in `fn(*args)`, parameters excluded."""
    params = {p.untyped_storage()._cdata for a in args if isinstance(a, nn.Module)
              for p in a.parameters()}  # fmt: skip
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in params:
            seen.setdefault(key, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def test_the_probe_counts_what_autograd_saves_and_the_live_objects_hold() -> None:
    """1f1b on 2 ranks in one process: rank 0 peaks with 2 microbatches in flight, rank 1 with
    one; every part equals what the stage's own objects give."""
    module = trained_mlp()
    program = module.pipeline.program
    x, y = _batch("mlp")
    xs, ys = torch.tensor_split(x, M), torch.tensor_split(y, M)
    measured = module.measured_memory
    for rank, in_flight in ((0, 2), (1, 1)):
        worker = module.pipeline.workers[(rank, rank)]
        params = sum(p.nbytes for p in worker.module.parameters())
        peak = measured[rank].peak
        assert (peak.params, peak.grads, peak.versions) == (params, params, 0)
        assert peak.optimizer == params  # one momentum buffer per parameter
        stage = program.stages[rank]
        if rank == 0:
            one = saved_bytes(lambda m, a: m(a), stage, xs[0].clone())
        else:
            hidden = program.stages[0](xs[0])
            inputs = {k: v.detach().requires_grad_(True) for k, v in hidden.items()}
            one = saved_bytes(lambda m, kw: F.cross_entropy(m(**kw), ys[0].clone()), stage, inputs)
        assert peak.activations == in_flight * one, rank
        assert measured[rank].stage_activations == {rank: peak.activations}
    assert measured[0].step_peaks[-1] == measured[0].peak.total


def test_activations_are_released_when_the_backward_frees_them() -> None:
    """After a synchronous step nothing is saved any more (under zb-h1 what I leaves for W goes
    with W); a streaming schedule keeps microbatches and weight versions across calls until a
    flush."""
    for module in (trained_mlp(), _local("mlp", "zb-h1")):
        for probe in module._probes.values():
            assert probe.activations == 0 and not probe.held
    streaming = _local("mlp", "pipedream")
    probe = streaming._probes[0]
    assert probe.static.versions > 0 and probe.activations > 0  # in flight across calls
    streaming.flush()
    probe.sample()
    assert probe.activations == 0


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_the_probe_changes_no_result(kind: str) -> None:
    """The same parameters with the probe on and off (its saved tensors are detached views of
    what autograd saves), also through a split backward; off, nothing is reported."""
    on, off = _local("mlp", kind), _local("mlp", kind, measure=False)
    assert all(w.probe is None for w in off.pipeline.workers.values())
    assert off.measured_memory == {} and "memory measured" not in off.explain()
    for key, worker in on.pipeline.workers.items():
        theirs = dict(off.pipeline.workers[key].module.named_parameters())
        for name, p in worker.module.named_parameters():
            assert torch.equal(p, theirs[name]), (kind, key, name)


def test_explain_shows_measured_against_predicted() -> None:
    module = trained_mlp()
    text = module.explain()
    for rank in (0, 1):
        memory = module.measured_memory[rank].peak.total
        assert f"memory measured {human_bytes(memory)} against predicted" in text
    assert "measured at its peak: params" in text and "message buffers" in text
    assert "on the CPU, measured:" in text and "stage 1: predicted peak" in text


def test_compile_switches_the_probe_on() -> None:
    torch.manual_seed(0)
    model, x = zoo.MLP(p=0.0).train(), torch.randn(8, 32)
    y = torch.randint(0, 10, (8,))
    pipe = pdcompile.compile(model, (x[:2],), loss_fn=F.cross_entropy, cluster="2",
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1), profile=False,
                             num_microbatches=4, measure_memory=True)  # fmt: skip
    pipe.train_step(x, y)
    assert sorted(pipe.measured_memory) == [0, 1]
    assert all(m.peak.total > 0 for m in pipe.measured_memory.values())


def test_a_wrong_model_fails_the_comparison() -> None:
    """The same measurement against the plan with every stage's activations half as large
    again: rank 0 (two microbatches in flight) is off by a fifth."""
    module = trained_mlp()
    plan, measured = module.plan, module.measured_memory
    _check("mlp", "1f1b", plan, measured)
    stages = tuple(
        dataclasses.replace(s, activation_bytes=3 * s.activation_bytes // 2) for s in plan.stages
    )
    inflated = simulated(plan.with_(stages=stages))
    with pytest.raises(AssertionError, match="mlp 1f1b rank 0"):
        _check("mlp", "1f1b", inflated, measured)


@pytest.mark.parametrize("case", ["mlp", "gpt"])
def test_autocast_activations_are_measured_at_their_dtype(case: str) -> None:
    """Under bf16 autocast the analysis saves what the run saves (bf16 activations, the bf16
    copies of the weights a matrix product keeps, fp32 where autocast keeps it): the model
    holds less than in fp32 and still equals the probe within the tolerance."""
    model, x, y, loss_fn, optimizer = CASES[case]()
    gm = pdcompile.trace(model, (x,))
    saved = {}
    for dtype in (None, torch.bfloat16):
        costs = pdcompile.analyze(
            gm, (x,), profile=False, optimizer=optimizer, loss_fn=loss_fn, targets=y,
            cache=False, progress=False, autocast=dtype,
        )  # fmt: skip
        saved[dtype] = costs.totals()["activation_bytes"]
    assert saved[torch.bfloat16] < saved[None]
    plan = pdcompile.plan(costs, 2, num_microbatches=M, replica_counts=[1], recompute=False)
    pipeline = LocalPipeline(
        pdcompile.codegen(gm, plan), schedule="1f1b", num_microbatches=M, loss_fn=loss_fn,
        optimizer=optimizer, autocast=torch.bfloat16,
    )  # fmt: skip
    module = PipelinedModule(pipeline, rank=0)
    module.measure_memory()
    batch = _batch(case)
    for _ in range(STEPS):
        module.train_step(*batch)
    _check(case, "1f1b (bf16)", module.plan, module.measured_memory)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_allocator_peak_is_reported_and_bounds_the_parts() -> None:
    """The same probe on CUDA tensors: the allocator's peak (both ranks of the process, and the
    transients) is at least what either rank's parts add up to."""
    model, x, y, loss_fn, optimizer = CASES["mlp"]()
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False, optimizer=optimizer, loss_fn=loss_fn,
                              targets=y, cache=False, progress=False)  # fmt: skip
    plan = pdcompile.plan(costs, 2, num_microbatches=M, replica_counts=[1])
    pipeline = LocalPipeline(pdcompile.codegen(gm, plan), schedule="1f1b", num_microbatches=M,
                             loss_fn=loss_fn, optimizer=optimizer)  # fmt: skip
    module = PipelinedModule(pipeline, rank=0)
    module.measure_memory()
    for _ in range(STEPS):
        module.train_step(torch.cat([x] * M), torch.cat([y] * M))
    measured = module.measured_memory
    for memory in measured.values():
        assert memory.cuda_peak is not None and memory.cuda_peak >= memory.peak.total
    _check("mlp", "1f1b", module.plan, measured)
    assert "CUDA allocator peak" in module.explain()


# -- 2 gloo ranks: every model under every schedule -----------------------------------------


def _measure(rank: int, world_size: int, init_file: str, configs: list) -> list:
    """Every configuration in one spawned group: the plan's per-rank memory and this rank's
    measurement."""
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    torch.set_num_threads(1)
    results = []
    for case, kind, how in configs:
        _, _, _, loss_fn, optimizer = CASES[case]()
        pipeline = DistributedPipeline(
            _program(case, kind, how), rank=rank, schedule=kind, num_microbatches=M,
            loss_fn=loss_fn, optimizer=optimizer, device=device, timeout_s=60,
        )  # fmt: skip
        module = PipelinedModule(pipeline, rank=rank)
        module.measure_memory()
        x, y = _batch(case)
        for _ in range(STEPS):
            module.train_step(x, y)
        results.append((module.plan, module.measured_memory))
    dist.destroy_process_group()
    return results


@functools.cache
def gloo_results() -> dict[tuple[str, str, str], tuple]:
    """(case, schedule, recomputation) -> (plan, {rank: RankMemory}) from 2 spawned gloo
    ranks."""
    per_rank = run_ranks(_measure, 2, CONFIGS, timeout_s=420)
    out = {}
    for i, config in enumerate(CONFIGS):
        plans = [per_rank[r][i][0] for r in range(2)]
        assert plans[0].stages == plans[1].stages, config  # both ranks planned alike
        out[config] = (plans[0], {r: per_rank[r][i][1][r] for r in range(2)})
    return out


@pytest.mark.parametrize(("case", "kind", "how"), CONFIGS)
def test_predicted_memory_is_within_ten_percent_on_gloo_ranks(
    case: str, kind: str, how: str
) -> None:
    plan, measured = gloo_results()[(case, kind, how)]
    assert [bool(s.recompute) for s in plan.stages] == [how != "none"] * 2
    _check(case, f"{kind} ({how})", plan, measured)
    if how != "none":  # the run really recomputes: a rank keeps less than without (under
        # zb-h1 the last stage's I follows its F at once, and holds as much)
        _, without = gloo_results()[(case, kind, "none")]
        less = [measured[r].peak.total < without[r].peak.total for r in measured]
        assert any(less), (case, kind, how, less)
