"""What a rank holds for its messages is bounded, whatever the microbatches of a step, and the
memory model counts it (`pdcompile/core/message_buffers.py`; issue 31: 4 ranks of an
MLP(1024) x 8 at 64 microbatches held 16 MiB of message buffers on a middle rank, the
received inputs and their gradients of every microbatch until the step's end and every send
until its flush, where the plan counted none)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pipeline_support import program_for
from spawn import run_ranks

import pdcompile
from pdcompile import Cluster, CostGraph, Plan, Stage
from pdcompile.compiling.pipelined_module import PipelinedModule
from pdcompile.core.message_buffers import IN_USE, held_bytes, stage_bytes
from pdcompile.passes.planning.stage_sums import edge_bytes
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline

ROWS, WIDTH, STAGES = 4, 256, 3
MESSAGE = ROWS * WIDTH * 4  # a microbatch's activations, or their gradients
COUNTS = (6, 48)  # microbatches per step


def _program() -> pdcompile.StagedProgram:
    torch.manual_seed(0)
    layers = [m for _ in range(STAGES) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]
    return program_for(nn.Sequential(*layers), torch.randn(ROWS, WIDTH), [1] * STAGES)


def _measure(rank: int, world_size: int, init_file: str) -> dict:
    device = init_process_group(rank, world_size, init_file=init_file, backend="gloo", timeout_s=60)
    torch.set_num_threads(1)
    out = {}
    for m in COUNTS:
        pipeline = DistributedPipeline(
            _program(), rank=rank, schedule="1f1b", num_microbatches=m, loss_fn=F.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device=device, timeout_s=60,
        )  # fmt: skip
        module = PipelinedModule(pipeline, rank=rank)
        module.measure_memory()
        x, y = torch.randn(m * ROWS, WIDTH), torch.randn(m * ROWS, WIDTH)
        for _ in range(2):
            module.train_step(x, y)
        out[m] = module.measured_memory[rank].messages
        module.close()
    dist.destroy_process_group()
    return out


def test_message_buffers_stay_bounded_and_are_the_modelled_slabs() -> None:
    """3 gloo ranks under 1f1b, 6 and 48 microbatches: the buffers in use at once (receives
    posted a window ahead, sends not yet known complete, received inputs' gradients on their
    way back) are what `simulate` counts in `message_memory` (`IN_USE` of each message size,
    without the wire's preamble), within two messages, at either count."""
    ranks = run_ranks(_measure, STAGES, timeout_s=180)
    plan = _program().plan
    for m in COUNTS:
        model = pdcompile.simulate(plan, schedule="1f1b", num_microbatches=m).message_memory
        for rank, out in enumerate(ranks):
            assert model[rank] == IN_USE * MESSAGE
            # the window and the sends, and a received input's gradient on its way back
            assert out[m] <= model[rank] + 2 * (MESSAGE + 64), (m, rank, out[m], model[rank])
    for out in ranks:
        assert out[COUNTS[1]] <= out[COUNTS[0]] + MESSAGE  # not more with 8x the microbatches


def _stage(index: int, ranks: tuple[int, ...], recv: tuple = ()) -> Stage:
    return Stage(index=index, nodes=(f"n{index}",), replicas=len(ranks), ranks=ranks,
                 forward_s=1.0, backward_s=2.0, recv_bytes=recv)  # fmt: skip


def test_the_model_keeps_the_buffers_of_each_message_size_of_each_rank() -> None:
    """Stage 1 receives 1000 B from stage 0 and sends 3000 B to stage 2, whose second stage
    on the same rank gets its 500 B handed over: `IN_USE` buffers per size a rank sends or
    receives over the wire, in the peak and not in what the probe's parts see
    (`held_memory`)."""
    stages = (
        _stage(0, (0,)),
        _stage(1, (1,), ((0, 1000),)),
        _stage(2, (2,), ((1, 3000),)),
        _stage(3, (2,), ((2, 500),)),
    )
    plan = Plan(stages=stages, cluster=Cluster.parse("3"), schedule="gpipe", num_microbatches=2)
    sim = pdcompile.simulate(plan)
    assert sim.message_memory == [held_bytes([1000]), held_bytes([1000, 3000]),
                                  held_bytes([3000])]  # fmt: skip
    assert sim.message_memory == [IN_USE * 1000, IN_USE * 4000, IN_USE * 3000]
    assert [p - b for p, b in zip(sim.peak_memory, sim.message_memory, strict=True)] == (
        sim.schedule_memory
    )
    assert sim.held_memory == sim.schedule_memory  # no recomputation: the probe's parts


def test_the_solvers_bound_covers_a_stage_that_sends_to_two_stages() -> None:
    """The solvers charge a stage `stage_bytes` of the edges across its two boundaries: at
    least what the simulation holds, also where a stage sends to two later stages (found by
    hypothesis: a charge of the tensors crossing each boundary once let `ideal` return a plan
    that did not fit)."""
    g = CostGraph(batch_size=8)
    for i in range(4):
        g.add_node(f"n{i}", forward_s=1.0, backward_s=2.0, param_bytes=8, grad_bytes=8)
    for u, v, nbytes in [(0, 1, 11), (0, 2, 12), (1, 2, 22), (1, 3, 23)]:
        g.add_edge(f"n{u}", f"n{v}", nbytes)
    edges = edge_bytes(g, [f"n{i}" for i in range(4)])
    assert edges == [0, 23, 57, 23, 0]
    plan = Plan(stages=tuple(_stage(i, (i,)) for i in range(4)), cluster=Cluster.parse("4"),
                num_microbatches=2)  # fmt: skip
    sim = pdcompile.simulate(pdcompile.evaluate(plan, g))
    assert sim.message_memory == [held_bytes([11, 12]), held_bytes([11, 22, 23]),
                                  held_bytes([12, 22]), held_bytes([23])]  # fmt: skip
    for s in range(4):
        assert sim.message_memory[s] <= stage_bytes(edges[s], edges[s + 1])


def test_a_replicated_stage_charges_every_replica() -> None:
    stages = (_stage(0, (0, 1)), _stage(1, (2,), ((0, 1000),)))
    plan = Plan(stages=stages, cluster=Cluster.parse("3"), schedule="1f1b", num_microbatches=2)
    assert pdcompile.simulate(plan).message_memory == [IN_USE * 1000] * 3
