"""Any tensor crosses a stage boundary (issue 30, item 4).

Pure tier: `wire.pack` then `wire.unpack` gives back every tensor's values, whatever its strides
(a slice `y[..., ::2]`, a transpose, a view, an `expand`, a conjugate), its size (zero rows) or
dtype, next to metadata and other tensors. Single-process tier: a model whose stage boundary is
a strided slice, and whose gradient coming back is a transpose's, trains under the local executor
equal to gradient accumulation. Multi-process tier: the same model under every registered
schedule on 2 spawned gloo ranks (`pdcompile.compile` with the cut after each strided slice),
the synchronous schedules equal to single-process gradient accumulation, `pipedream` and `2bw`
to their own references (`tests/pipeline_support.py`).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_support import (
    OPTIMIZERS,
    accumulate_reference,
    pipedream_reference,
    stage_parameters,
    two_bw_reference,
)
from spawn import run_ranks

import pdcompile
from pdcompile import Cluster, Plan, Stage
from pdcompile.core.errors import StageCommError
from pdcompile.lowering.staged_program import Channel
from pdcompile.runtime import wire
from pdcompile.runtime.distributed import init_process_group
from pdcompile.scheduling import get_schedule

DTYPES = [
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip
KEY = ("act", 3, 0, 1)


def filled(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A contiguous tensor of distinct-looking values of `dtype`."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * 50
    if dtype == torch.bool:
        return values > 0
    if dtype.is_complex:
        return torch.complex(values, -values).to(dtype)
    return values.to(dtype)


def viewed(base: torch.Tensor, how: str) -> torch.Tensor:
    """A non-contiguous (or otherwise unusual) tensor made from a 3-d `base`."""
    if how == "strided":
        return base[..., ::2]
    if how == "transposed":
        return base.transpose(0, 2)
    if how == "narrowed":  # a view with a storage offset
        return base[1:, :, 1:]
    if how == "expanded":  # stride 0
        return base[:, :1].expand(-1, 3, -1)
    if how == "conjugate" and base.is_complex():
        return base.conj()
    if how == "negative" and base.is_complex():
        return base.conj().imag  # the negative bit
    return base


HOWS = ["contiguous", "strided", "transposed", "narrowed", "expanded", "conjugate", "negative"]


def round_trip(values: list, channels: list[Channel], rows: int) -> list:
    lay = wire.layout(tuple(channels), rows)
    buffer, error = wire.pack(values, lay, KEY, torch.device("cpu"), 0, 1)
    assert error is None, error
    assert buffer.numel() == lay.size and all(s.offset % 8 == 0 for s in lay.slots)
    return wire.unpack(buffer.clone(), lay, KEY)


def channel_of(name: str, value: torch.Tensor) -> Channel:
    dtype = str(value.dtype).removeprefix("torch.")
    shape = ("batch", *value.shape[1:]) if value.dim() else ()
    return Channel(0, 1, name, shape=shape, dtype=dtype)


@settings(deadline=None, max_examples=120)
@given(
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=4),
    hows=st.lists(st.sampled_from(HOWS), min_size=4, max_size=4),
    rows=st.integers(0, 5),
    width=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_pack_then_unpack_gives_back_any_tensor(
    dtypes: list[torch.dtype], hows: list[str], rows: int, width: int, seed: int
) -> None:
    """Several tensors in one message, each of any dtype and view, zero rows included, with a
    metadata value between them: each comes back equal, with its dtype and shape."""
    values, channels = [], []
    for i, (dtype, how) in enumerate(zip(dtypes, hows, strict=False)):
        value = viewed(filled((rows + 2, 3, 2 * width), dtype, seed + i), how)
        value = value[: min(rows, value.shape[0])] if how != "transposed" else value
        values.append(value)
        channels.append(channel_of(f"t{i}", value))
    values.insert(1, torch.Size([rows, width]))
    channels.insert(1, Channel(0, 1, "size", kind="value", value_type="Size"))
    rows_of = {v.shape[0] for v in values if isinstance(v, torch.Tensor)}
    channels = [
        c if c.kind != "tensor" else Channel(0, 1, c.name, shape=v.shape, dtype=c.dtype)
        for c, v in zip(channels, values, strict=True)
    ]  # concrete shapes: the transposed value's rows are not the batch
    received = round_trip(values, channels, min(rows_of))
    assert received[1] == torch.Size([rows, width])
    for sent, got in zip(values, received, strict=True):
        if isinstance(sent, torch.Tensor):
            assert got.dtype == sent.dtype and got.shape == sent.shape
            assert torch.equal(got.resolve_conj().resolve_neg(), sent.resolve_conj().resolve_neg())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_at_the_batch_rows(dtype: torch.dtype) -> None:
    """A symbolic batch dimension, 0-d tensors and a zero-size one of each dtype."""
    y = filled((4, 3, 6), dtype, 7)
    values = [y[..., ::2], y[0, 0, 0], y[:, :0], y.transpose(1, 2)]
    channels = [
        Channel(0, 1, "a", shape=("batch", 3, 3), dtype=str(dtype).removeprefix("torch.")),
        Channel(0, 1, "b", shape=(), dtype=str(dtype).removeprefix("torch.")),
        Channel(0, 1, "c", shape=("batch", 0, 6), dtype=str(dtype).removeprefix("torch.")),
        Channel(0, 1, "d", shape=("batch", 6, 3), dtype=str(dtype).removeprefix("torch.")),
    ]
    for sent, got in zip(values, round_trip(values, channels, 4), strict=True):
        assert got.dtype == dtype and got.shape == sent.shape and torch.equal(got, sent)


def test_a_sparse_tensor_is_refused_naming_the_channel() -> None:
    channel = Channel(0, 1, "h", shape=("batch", 3), dtype="float32")
    lay = wire.layout((channel,), 2)
    sparse = torch.eye(2, 3).to_sparse()
    buffer, error = wire.pack([sparse], lay, KEY, torch.device("cpu"), 0, 1)
    assert isinstance(error, StageCommError)
    assert "channel 'h'" in str(error) and "to_dense()" in str(error)
    with pytest.raises(StageCommError, match="to_dense"):
        wire.unpack(buffer, lay, KEY)


# -- a model whose stage boundaries are strided slices ----------------------------------------

WIDTH, ROWS, STEPS = 6, 8, 3


class Block(nn.Module):
    """A transpose (its gradient, sent back over the boundary before it, is non-contiguous),
    a Linear, and a strided slice (sent forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, 2 * WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h.transpose(-1, -2))[..., ::2]  # [batch, WIDTH, WIDTH], strided


class Strided(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(blocks)])
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).flatten(1)


def strided_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(ROWS, WIDTH, WIDTH)
    return Strided().train(), x, torch.randn(ROWS, 3 * WIDTH)


def strided_plan(kind: str, num_ranks: int = 2) -> tuple[Plan, int]:
    """A plan cut right after strided slices: 2 stages (after the second slice) for one stage
    per rank, else `default_chunks` stages per rank (after each slice), placed as the schedule
    places them; with the smallest microbatch count it accepts from 4 on."""
    model, x, _ = strided_case()
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False)
    names = list(costs.nodes)
    slices = [i + 1 for i, n in enumerate(names) if n.startswith("getitem")]  # y[..., ::2]
    rules = get_schedule(kind)
    chunks = rules.default_chunks
    num_stages = num_ranks * chunks
    cuts = [slices[1]] if num_stages == 2 else slices[: num_stages - 1]
    bounds = [0, *cuts, len(names)]
    stages = tuple(
        Stage(index=i, nodes=tuple(names[bounds[i] : bounds[i + 1]]), replicas=1,
              ranks=(rules.chunk_rank(i, num_ranks, chunks),))
        for i in range(num_stages)
    )  # fmt: skip
    m = rules.accepted_microbatches([1] * num_stages, 4)
    plan = Plan(stages=stages, cluster=Cluster.parse(str(num_ranks)))
    return pdcompile.evaluate(plan.with_(schedule=kind, num_microbatches=m), costs), m


def trained(kind: str, optimizer: str) -> dict[str, torch.Tensor]:
    """`compile` the strided model with its plan for `kind` and train it: this rank's
    parameters (every rank's under the local executor)."""
    model, x, y = strided_case()
    plan, _ = strided_plan(kind, 2)
    opt = OPTIMIZERS[optimizer]
    module = pdcompile.compile(model, (x,), loss_fn=F.mse_loss, optimizer=opt, plan=plan,
                               schedule=kind, timeout=60, startup_timeout=60)  # fmt: skip
    for _ in range(STEPS):
        module.train_step(x, y)
    module.flush()
    return stage_parameters(module.pipeline)


def expected(kind: str, optimizer: str) -> dict[str, torch.Tensor]:
    """What `kind` computes: gradient accumulation for a synchronous schedule, else the
    schedule's own reference."""
    model, x, y = strided_case()
    plan, m = strided_plan(kind)
    opt = OPTIMIZERS[optimizer]
    if kind == "pipedream":
        program = pdcompile.codegen(pdcompile.trace(model, (x,)), plan)
        live = pipedream_reference(program, x, y, F.mse_loss, opt, m, STEPS)
        return {n: p for stage in live for n, p in stage.named_parameters()}
    if kind == "2bw":
        return dict(two_bw_reference(model, x, y, F.mse_loss, opt, m, STEPS).named_parameters())
    assert get_schedule(kind).synchronous, f"{kind}: add its reference here"
    ref, _ = accumulate_reference(model, x, y, F.mse_loss, opt, m, STEPS)
    return dict(ref.named_parameters())


def assert_equal(trained: dict, kind: str, optimizer: str, where: str) -> None:
    reference = expected(kind, optimizer)
    assert trained.keys() == reference.keys(), kind
    for name, value in trained.items():
        torch.testing.assert_close(value, reference[name], msg=f"{kind} {where}: {name}")


def built_in_schedules() -> list[str]:
    """The package's schedules (not those other tests register in this process only, which
    spawned ranks would not know)."""
    return sorted(k for k in pdcompile.schedules()
                  if type(get_schedule(k)).__module__.startswith("pdcompile."))  # fmt: skip


@pytest.mark.parametrize("kind", built_in_schedules())
def test_strided_boundaries_train_under_the_local_executor(kind: str) -> None:
    assert_equal(trained(kind, "sgd"), kind, "sgd", "(local executor)")


def _train_every_schedule(rank: int, world_size: int, init_file: str, configs: list) -> list:
    init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    try:
        return [trained(kind, optimizer) for kind, optimizer in configs]
    finally:
        dist.destroy_process_group()


def test_strided_boundaries_train_under_every_schedule_on_two_ranks() -> None:
    """One spawned group of 2 gloo ranks trains every registered schedule in turn."""
    kinds = built_in_schedules()
    configs = [(kind, "adam" if i % 2 else "sgd") for i, kind in enumerate(kinds)]
    per_rank = run_ranks(_train_every_schedule, 2, configs, timeout_s=300)
    for i, (kind, optimizer) in enumerate(configs):
        both = {n: t for rank in per_rank for n, t in rank[i].items()}
        assert_equal(both, kind, optimizer, f"on 2 ranks ({optimizer})")
