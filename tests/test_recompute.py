"""Activation recomputation (`Stage.recompute`: `runtime/recompute.py`,
`pdcompile/lowering/stage_segments.py`).

Single-process tier: the GPT with dropout on, cut in 2 stages (4 for `interleaved-1f1b` and
`zb-v`), trains 5 steps under every schedule with each stage recomputed whole (True) and in
segments, and every parameter equals, bit for bit, the run without recomputation (the RNG is
restored, the recomputed forward uses the stashed weight version); without the RNG restored
they differ. The memory probe measures exactly the stage inputs and boundaries kept; a split
backward runs the forward twice per microbatch (W reuses I's recomputation); autocast is
re-entered; bad boundaries are named. Multi-process tier: 2 spawned gloo ranks run every
schedule with and without recomputation (one group) and measure the memory of one.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from pipeline_support import one_thread, stage_parameters
from schedule_kinds import builtin_kinds
from spawn import run_ranks
from support import Ops

import pdcompile
from pdcompile import zoo
from pdcompile.compiling.pipelined_module import PipelinedModule
from pdcompile.core.ir import OUTPUTS
from pdcompile.lowering.stage_segments import cut_stage
from pdcompile.runtime import recompute
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline
from pdcompile.runtime.local import LocalPipeline

M = 4  # microbatches per step
STEPS = 5
ROWS = 8  # rows per step: microbatches of 2
SCHEDULES = builtin_kinds()  # every schedule of the package, from its registry


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Every run at one thread, as the spawned ranks run (on a loaded machine 10x faster)."""
    with one_thread():
        yield


@functools.cache
def _case() -> tuple:
    """The GPT with dropout on (4 blocks: a block per stage when cut in 4), traced."""
    torch.manual_seed(0)
    model = zoo.GPT(zoo.GPTConfig(dropout=0.1, n_layer=4)).train()
    x, y = torch.randint(0, 128, (ROWS, 16)), torch.randint(0, 128, (ROWS, 16))
    gm = pdcompile.trace(model, (x,))
    return gm, pdcompile.analyze(gm, (x,), profile=False), x, y


@functools.cache
def _cut(kind: str) -> pdcompile.StagedProgram:
    gm, costs, _, _ = _case()
    plan = pdcompile.plan(costs, "2", solver="dp", schedule=kind, num_microbatches=M,
                          replica_counts=[1])  # fmt: skip
    return pdcompile.codegen(gm, plan)


def boundaries(stage: torch.fx.GraphModule) -> tuple[str, ...]:
    """The residual stream where a layer norm reads it: after attention and after each block."""
    norms = ("ln_1", "ln_2", "ln_f")
    return tuple(
        n.name
        for n in stage.graph.nodes
        if n.op == "call_function" and any(u.name.endswith(norms) for u in n.users)
    )


def program(kind: str, mode: bool | str) -> pdcompile.StagedProgram:
    """A fresh copy of the cut for `kind`, every stage recomputed as `mode` says (False, True or
    "segments")."""
    cut = copy.deepcopy(_cut(kind))
    if mode:
        stages = tuple(
            dataclasses.replace(s, recompute=mode is True or boundaries(cut.stages[s.index]))
            for s in cut.plan.stages
        )
        cut.plan = cut.plan.with_(stages=stages)
    return cut


def trained(kind: str, mode: bool | str, **options) -> LocalPipeline:  # noqa: ANN003
    """`STEPS` steps on the local executor from the same RNG state (flushed)."""
    _, _, x, y = _case()
    pipeline = LocalPipeline(program(kind, mode), schedule=kind, num_microbatches=M,
                             loss_fn=loss_fn, optimizer=sgd, **options)  # fmt: skip
    torch.manual_seed(1)
    for _ in range(STEPS):
        pipeline.train_step((x,), y)
    pipeline.flush()
    return pipeline


def assert_same_parameters(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for name, value in got.items():
        assert torch.equal(value, expected[name]), f"{what}: {name}"


# -- the segments ---------------------------------------------------------------------------


def test_segments_compute_the_stage_and_leave_it_as_it_was() -> None:
    """Chained, the segments compute what the stage computes (dropout drawing alike), each
    after the first taking only the boundary before it; the stage keeps its names."""
    cut, (_, _, x, _) = _cut("1f1b"), _case()
    stage = cut.stages[1]
    keys, names = list(stage.state_dict()), [n for n, _ in stage.named_parameters()]
    inputs = {k: v.detach() for k, v in cut.stages[0](x).items()}
    segments = cut_stage(stage, boundaries(stage), 1)
    assert len(segments) == len(boundaries(stage)) + 1 == 5
    assert [s.inputs for s in segments[1:]] == [(b,) for b in boundaries(stage)]
    torch.manual_seed(2)
    expected = stage(**inputs)
    torch.manual_seed(2)
    known = dict(inputs)
    for segment in segments[:-1]:
        values = segment(stage, *map(known.get, segment.inputs))
        known.update(zip(segment.outputs, values, strict=True))
    result = segments[-1](stage, *map(known.get, segments[-1].inputs))
    assert torch.equal(result, expected)
    assert list(stage.state_dict()) == keys and [n for n, _ in stage.named_parameters()] == names


def test_a_boundary_must_be_a_node_of_the_stage_computing_one_tensor() -> None:
    with pytest.raises(pdcompile.CodegenError, match=r"stage 1: recompute boundary 'add_1' is "
                       r"not a node of the stage .* choose among its nodes: h_"):  # fmt: skip
        trained_with = program("1f1b", False)
        stages = list(trained_with.plan.stages)
        stages[1] = dataclasses.replace(stages[1], recompute=("add_1",))  # a node of stage 0
        trained_with.plan = trained_with.plan.with_(stages=tuple(stages))
        LocalPipeline(trained_with, schedule="1f1b", num_microbatches=M, loss_fn=loss_fn,
                      optimizer=sgd)  # fmt: skip
    cut = program("1f1b", False)
    with pytest.raises(pdcompile.CodegenError, match="'size' is not a node of the stage that "
                       "computes one tensor"):  # fmt: skip
        cut_stage(cut.stages[0], ["size"], 0)  # an int
    for node in cut.stages[0].graph.nodes:  # a graph without recorded values (a loaded one)
        node.meta.pop(OUTPUTS, None)
    stages = list(cut.plan.stages)
    stages[0] = dataclasses.replace(stages[0], recompute=("size",))
    cut.plan = cut.plan.with_(stages=tuple(stages))
    pipeline = LocalPipeline(cut, schedule="1f1b", num_microbatches=M, loss_fn=loss_fn,
                             optimizer=sgd)  # fmt: skip
    _, _, x, y = _case()
    with pytest.raises(pdcompile.CodegenError, match="stage 0: recompute boundary 'size' "
                       "computes a value of type int, not a tensor"):  # fmt: skip
        pipeline.train_step((x,), y)


# -- every schedule: the same parameters as without recomputation -----------------------------


@functools.cache
def without(kind: str) -> dict:
    return {n: p for m in trained(kind, False).stage_modules().values()
            for n, p in m.named_parameters()}  # fmt: skip


@pytest.mark.parametrize("kind", SCHEDULES)
def test_recomputation_changes_no_parameter(kind: str) -> None:
    """Whole stages and segments (a split backward: I's rerun), 5 steps, dropout on."""
    for mode in (True, "segments"):
        pipeline = trained(kind, mode)
        assert all(w.recompute is not None for w in pipeline.workers.values())
        got = {n: p for m in pipeline.stage_modules().values() for n, p in m.named_parameters()}
        assert_same_parameters(got, without(kind), f"{kind}, recompute {mode}")


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_without_the_rng_restored_the_parameters_differ(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison above can fail: a recomputation drawing new dropout masks (the checkpoint
    not restoring the RNG, or I's rerun not taking the forward's state) changes the result."""
    if kind == "zb-h1":
        monkeypatch.setattr(recompute, "_again", lambda rng, whole, values: whole(*values))
    else:
        plain = recompute.checkpoint
        monkeypatch.setattr(recompute, "checkpoint", lambda fn, *args, **kw: plain(
            fn, *args, **{**kw, "preserve_rng_state": False}))  # fmt: skip
    pipeline = trained(kind, True)
    got = {n: p for m in pipeline.stage_modules().values() for n, p in m.named_parameters()}
    assert any(not torch.equal(p, without(kind)[n]) for n, p in got.items())


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_autocast_is_entered_again(kind: str) -> None:
    """bfloat16 autocast around the forward: the recomputation (the checkpoint's, I's rerun)
    computes in it too."""
    autocast = trained(kind, False, autocast=torch.bfloat16).stage_modules().values()
    expected = {n: p for m in autocast for n, p in m.named_parameters()}
    assert any(not torch.equal(p, without(kind)[n]) for n, p in expected.items())  # it acts
    pipeline = trained(kind, True, autocast=torch.bfloat16)
    got = {n: p for m in pipeline.stage_modules().values() for n, p in m.named_parameters()}
    assert_same_parameters(got, expected, f"{kind} under autocast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_on_cuda_dropout_draws_the_same_masks_again(kind: str) -> None:
    """CUDA's generator restored too, by the checkpoint and by I's rerun."""
    _, _, x, y = _case()
    found = []
    for mode in (False, True):
        cut = program(kind, mode)
        for stage in cut.stages:
            stage.cuda()
        pipeline = LocalPipeline(cut, schedule=kind, num_microbatches=M, loss_fn=loss_fn,
                                 optimizer=sgd)  # fmt: skip
        torch.manual_seed(1)
        for _ in range(STEPS):
            pipeline.train_step((x.cuda(),), y.cuda())
        modules = pipeline.stage_modules().values()
        found.append({n: p for m in modules for n, p in m.named_parameters()})
    assert_same_parameters(found[1], found[0], f"{kind} on CUDA")


# -- what it keeps and what it runs ---------------------------------------------------------


def kept_bytes(cut: pdcompile.StagedProgram, stage: int, segments: bool) -> int:
    """A microbatch's stage inputs (stage 0: the token ids) and, in segments, its boundaries."""
    rows = ROWS // M
    _, _, x, _ = _case()
    if stage == 0:
        total = x[:rows].nbytes
    else:
        total = sum(
            torch.empty(c.shape_for(rows), dtype=getattr(torch, c.dtype)).nbytes
            for c in cut.channels_to(stage) if c.kind == "tensor"
        )  # fmt: skip
    if segments:
        nodes = {n.name: n for n in cut.stages[stage].graph.nodes}
        total += sum(nodes[b].meta[OUTPUTS][0].nbytes * rows // ROWS
                     for b in boundaries(cut.stages[stage]))  # fmt: skip
    return total


def measured(kind: str, mode: bool | str) -> dict:
    """The memory probe's reading over 2 steps on the local executor, by rank."""
    _, _, x, y = _case()
    pipeline = LocalPipeline(program(kind, mode), schedule=kind, num_microbatches=M,
                             loss_fn=loss_fn, optimizer=sgd)  # fmt: skip
    module = PipelinedModule(pipeline, rank=0)
    module.measure_memory()
    for _ in range(2):
        module.train_step(x, y)
    return module.measured_memory


@pytest.mark.parametrize("kind", ["1f1b", "2bw"])
def test_the_probe_measures_what_recomputation_keeps(kind: str) -> None:
    """At each rank's peak, rank 0 holds 2 microbatches in flight and rank 1 one: their saved
    activations are exactly the stage inputs (recomputed whole; the last stage's loss is
    recomputed too) or the inputs and boundaries (in segments): under a tenth and a fifth of
    what the run without recomputation saves."""
    cut = _cut(kind)
    plain, whole, segments = (measured(kind, m) for m in (False, True, "segments"))
    for rank, in_flight in ((0, 2), (1, 1)):
        assert whole[rank].peak.activations == in_flight * kept_bytes(cut, rank, False)
        assert segments[rank].peak.activations == in_flight * kept_bytes(cut, rank, True)
        assert 10 * whole[rank].peak.activations < plain[rank].peak.activations
        assert 5 * segments[rank].peak.activations < plain[rank].peak.activations


def layer_norms(kind: str, mode: bool | str) -> tuple[int, LocalPipeline]:
    """Layer norm forwards in the second step (the first decides how each stage splits)."""
    _, _, x, y = _case()
    pipeline = LocalPipeline(program(kind, mode), schedule=kind, num_microbatches=M,
                             loss_fn=loss_fn, optimizer=sgd)  # fmt: skip
    pipeline.train_step((x,), y)
    with Ops() as ops:
        pipeline.train_step((x,), y)
    return ops.ops["native_layer_norm"], pipeline


def test_a_split_backward_recomputes_once_for_i_and_w() -> None:
    """The forward runs twice per microbatch with recomputation, fused or split: W reuses I's
    graph (under the checkpoint's own recomputation W would run it again per weight group)."""
    once, _ = layer_norms("1f1b", False)
    assert once == M * 9  # 4 blocks of 2, and the last
    for kind in ("1f1b", "zb-h1"):
        for mode in (True, "segments"):
            count, pipeline = layer_norms(kind, mode)
            assert count == 2 * once, (kind, mode)
    assert all(w.fused == "" for w in pipeline.workers.values())  # zb-h1 split I and W


# -- 2 gloo ranks -----------------------------------------------------------------------------

# every schedule once on gloo, whole and in segments in turn (both on the local executor)
GLOO = [(kind, True if i % 2 == 0 else "segments") for i, kind in enumerate(SCHEDULES)]


def _train(rank: int, world_size: int, init_file: str, configs: list) -> list:
    """Every configuration without and with recomputation in one spawned group; 1f1b's memory
    measured."""
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=90)
    torch.set_num_threads(1)
    _, _, x, y = _case()
    results = []
    for kind, mode in configs:
        runs = []
        for recomputed in (False, mode):
            pipeline = DistributedPipeline(
                program(kind, recomputed), rank=rank, schedule=kind, num_microbatches=M,
                loss_fn=loss_fn, optimizer=sgd, device=device, timeout_s=90,
            )  # fmt: skip
            module = PipelinedModule(pipeline, rank=rank)
            module.measure_memory(kind == "1f1b")
            torch.manual_seed(1 + rank)
            for _ in range(STEPS):
                module.train_step(x, y)
            pipeline.flush()
            runs.append((stage_parameters(pipeline), module.measured_memory.get(rank)))
        results.append(runs)
    dist.destroy_process_group()
    return results


def test_recomputation_changes_no_parameter_on_gloo_ranks() -> None:
    per_rank = run_ranks(_train, 2, GLOO, timeout_s=240)
    for i, (kind, mode) in enumerate(GLOO):
        for rank in (0, 1):
            (plain, plain_memory), (got, memory) = per_rank[rank][i]
            assert_same_parameters(got, plain, f"{kind}, recompute {mode}, rank {rank}")
            if kind == "1f1b":  # rank 1's inputs: copied out of the pooled message buffer
                cut = _cut(kind)  # (runtime/message_pool.py), so their own bytes
                kept = kept_bytes(cut, rank, False)
                assert memory.peak.activations == (2 - rank) * kept
                assert 10 * memory.peak.activations < plain_memory.peak.activations
