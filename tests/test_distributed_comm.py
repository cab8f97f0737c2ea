"""`DistributedComm` over gloo in spawned ranks: messages, channel checks, all-reduces, dead peers.

Each test spawns one group of ranks and runs several checks in it (spawning costs seconds); the
ranks return what they saw and the parent asserts.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from spawn import RankFailed, run_ranks

from pdcompile.core.errors import PipelineTimeoutError, StageCommError
from pdcompile.lowering.staged_program import Channel
from pdcompile.runtime.distributed import DistributedComm, init_process_group, message_tag
from pdcompile.runtime.wire import decode_value, encode_value

METADATA = [
    7,
    torch.Size([4, 3]),
    (1, "a", None, 2.5, (True, -1)),
    None,
    torch.float16,
    torch.device("cpu"),
    [1, (2, 3), "x"],
    float("inf"),
]
CHANNELS = [
    Channel(0, 1, "h", shape=("batch", 3), dtype="float32", requires_grad=True),
    Channel(0, 1, "ids", shape=("batch", 5), dtype="int64"),
    Channel(0, 1, "half", shape=("batch",), dtype="bfloat16"),
    Channel(0, 1, "mask", shape=("batch", 2, 1), dtype="bool"),
    Channel(0, 1, "heads", shape=("2*batch", 2), dtype="float64"),
    Channel(0, 1, "scalar", shape=(), dtype="float32"),
    *(Channel(0, 1, f"meta{i}", kind="value", value_type=type(v).__name__) for i, v in
      enumerate(METADATA)),
]  # fmt: skip
GRAD = [Channel(1, 0, "h", shape=("batch", 3), dtype="float32")]
ONE = CHANNELS[:1]


def message(microbatch: int, batch: int) -> list:
    """The values of `CHANNELS` for one microbatch of `batch` rows, the same on every rank."""
    gen = torch.Generator().manual_seed(microbatch)
    return [
        torch.randn(batch, 3, generator=gen).requires_grad_(),
        torch.randint(-(2**40), 2**40, (batch, 5), generator=gen),
        torch.randn(batch, generator=gen).to(torch.bfloat16),
        torch.rand(batch, 2, 1, generator=gen) > 0.5,
        torch.randn(2 * batch, 2, generator=gen, dtype=torch.float64).t().contiguous().t(),
        torch.tensor(float(microbatch)),
        *METADATA,
    ]


def act(microbatch: int) -> tuple[str, int, int, int]:
    return ("act", microbatch, 0, 1)


BATCHES = {0: 4, 1: 4, 2: 2, 6: 3}


def _two_ranks(rank: int, world_size: int, init_file: str, backend: str) -> dict:
    device = init_process_group(
        rank, world_size, init_file=init_file, backend=backend, timeout_s=60
    )
    comm = DistributedComm(rank, [], timeout_s=30, device=device)
    out: dict = {"errors": []}

    def send(mb: int, values: list, channels=CHANNELS, rows: int = 4) -> None:
        try:
            comm.send(1, act(mb), values, channels, rows)
        except StageCommError as exc:
            out["errors"].append(str(exc))

    if rank == 0:
        for mb in (0, 1, 2):  # all in flight before rank 1 receives
            send(mb, message(mb, BATCHES[mb]), rows=BATCHES[mb])
        bad = message(3, 4)
        bad[0] = torch.zeros(4, 7)  # a non-batch dimension differs
        send(3, bad)
        bad = message(4, 4)
        bad[0] = bad[0].double()  # the dtype differs
        send(4, bad)
        bad = message(5, 4)
        bad[3] = bad[3].squeeze(-1)  # one dimension fewer
        send(5, bad)
        send(6, message(6, 3), rows=3)
        send(7, [torch.Size([2, 3])], ONE)  # metadata where a tensor is expected
        send(8, [torch.ones(4, 3), 1], ONE)  # one value too many
        send(9, [torch.ones(5, 3)], ONE)  # another batch size than the microbatch's
        out["grad"] = comm.recv(1, ("grad", 0, 1, 0), GRAD, 4)  # rank 1 has received all
        out["sent"] = comm.pending_sends  # kept until known received
        comm.settle(lambda peer, key: key[1] < 3)  # those three only: their memory is free
        out["pending"] = comm.pending_sends
        comm.flush()
    else:
        for mb in (0, 1, 2, 6):  # posted early, before anything was sent
            comm.expect(0, act(mb), CHANNELS, BATCHES[mb])
        order = [2, 0, 1] if backend == "gloo" else [0, 1, 2]  # NCCL matches in order
        out["received"] = {mb: comm.recv(0, act(mb), CHANNELS, BATCHES[mb]) for mb in order}
        for mb, channels in [(3, CHANNELS), (4, CHANNELS), (5, CHANNELS), (7, ONE), (8, ONE),
                             (9, ONE)]:  # fmt: skip
            try:
                comm.recv(0, act(mb), channels, 4)
            except StageCommError as exc:
                out["errors"].append(str(exc))
        out["after"] = comm.recv(0, act(6), CHANNELS, 3)
        comm.send(0, ("grad", 0, 1, 0), [torch.full((4, 3), 2.0, device=device)], GRAD, 4)
        comm.flush()
    dist.barrier()
    # A message may wait for its receiver longer than the timeout while nobody waits on it
    # (pipedream between train_step calls); a flush after it was received succeeds.
    side = dist.FileStore(init_file + ".side", world_size)
    lazy = DistributedComm(rank, [], timeout_s=1, device=device)
    if rank == 0:
        lazy.send(1, act(97), [torch.ones(2, 3)], ONE, 2)
        side.wait(["received"])
        lazy.flush()
    else:
        time.sleep(2)
        out["late"] = lazy.recv(0, act(97), ONE, 2)
        side.set("received", "1")
    # Last, as a gloo timeout closes the connection: rank 1 stays alive but never sends.
    if rank == 0:
        lazy.send(1, act(98), [torch.ones(2, 3)], ONE, 2)
        for name, wait in [
            ("unreceived", lazy.flush),
            ("timeout", lambda: lazy.recv(1, ("act", 99, 1, 0), GRAD, 2)),
        ]:
            try:
                wait()
            except PipelineTimeoutError as exc:
                out[name] = str(exc)
        side.set("done", "1")
    else:
        side.wait(["done"])
    dist.destroy_process_group()
    return _to_cpu(out)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def assert_same_values(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor) and not g.requires_grad
            assert g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(g, w.detach())
        else:
            assert type(g) is type(w) and g == w


def check_two_ranks(backend: str) -> None:
    sender, receiver = run_ranks(_two_ranks, 2, backend, timeout_s=120)

    for mb in (0, 1, 2):
        assert_same_values(receiver["received"][mb], message(mb, BATCHES[mb]))
    assert_same_values(receiver["after"], message(6, 3))
    assert torch.equal(sender["grad"][0], torch.full((4, 3), 2.0))
    if backend == "gloo":  # NCCL's sends are polled and released as they complete
        assert (sender["sent"], sender["pending"]) == (10, 7)
    assert sender["pending"] <= 7
    assert torch.equal(receiver["late"][0], torch.ones(2, 3))

    # the sender finds each mismatch, tells the receiver, and both raise the same error
    assert sender["errors"] == receiver["errors"] and len(sender["errors"]) == 6
    shape, dtype, ndim, kind, count, rows = sender["errors"]
    assert "channel 'h' (stage 0 -> 1)" in shape and "rank 0" in shape and "rank 1" in shape
    assert "float32[4, 7]" in shape and "float32[batch, 3] = float32[4, 3]" in shape
    assert "float64[4, 3]" in dtype and "float32[batch, 3]" in dtype
    assert "channel 'mask'" in ndim and "bool[4, 2]" in ndim and "bool[batch, 2, 1]" in ndim
    assert "channel 'h'" in kind and "sent Size" in kind and "float32[batch, 3]" in kind
    assert "rank 0 sends 2 values to rank 1, which expects 1 (h)" in count
    assert "float32[5, 3]" in rows and "float32[4, 3] for this microbatch" in rows

    unreceived = sender["unreceived"]
    assert "rank 0 gave up sending act of microbatch 98 (stage 0 -> 1) with rank 1" in unreceived
    timeout = sender["timeout"]
    assert "rank 0" in timeout and "rank 1" in timeout
    assert "act of microbatch 99 (stage 1 -> 0)" in timeout


def test_messages_round_trip_and_mismatches_raise_on_both_ranks() -> None:
    check_two_ranks("gloo")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_messages_round_trip_over_nccl() -> None:
    check_two_ranks("nccl")


def _three_ranks(rank: int, world_size: int, init_file: str) -> dict:
    init_process_group(rank, world_size, init_file=init_file, backend="gloo", timeout_s=60)
    groups = [(1, 0), (0, 1, 2), (0,), (1,), (2,)]
    comm = DistributedComm(rank, groups, timeout_s=30, device=torch.device("cpu"))
    out = {}
    if rank in (0, 1):
        pair = [
            torch.full((3, 2), rank + 1.0),
            torch.arange(4) * 10**12 * (rank + 1),  # int64 beyond float32's exactness
            torch.tensor(rank + 0.5, dtype=torch.float64),
        ]
        comm.all_reduce(pair, (1, 0), ("replicas", 0, -1, (0, 1)))
        out["pair"] = pair
    base = torch.arange(6.0).reshape(2, 3) * (rank + 1)
    everyone = [torch.full((5,), float(rank)), base.t()]  # a transposed view: not contiguous
    comm.all_reduce(everyone, (0, 1, 2), ("tie", 0, -1, (0, 1, 2)))
    out["everyone"], out["base"] = everyone, base
    mean = [torch.full((2,), float(rank)), torch.full((1,), 2.0 * rank, dtype=torch.float64)]
    comm.all_reduce(mean, (2, 0, 1), ("replicas", 0, 1, (0, 1, 2)), average=True)
    out["mean"] = mean
    rounding = [torch.tensor([(1e8, 1.0, -1e8)[rank]])]  # float32: the order of the sum shows
    comm.all_reduce(rounding, (0, 1, 2), ("tie", 1, -1, (0, 1, 2)))
    out["rounding"] = rounding[0]
    # over 1 MiB: in place; flattened with the small one (over 1 MiB too: gloo's all-reduce)
    # when not contiguous
    large = [torch.full((300_000,), rank + 1.0), torch.full((3,), rank + 0.5),
             (torch.arange(360_000.0).reshape(600, 600) * (rank + 1)).t()]  # fmt: skip
    comm.all_reduce(large, (0, 1, 2), ("tie", 2, -1, (0, 1, 2)), average=True)
    out["large"] = large
    alone = [torch.full((2,), 3.0 + rank)]
    comm.all_reduce(alone, (rank,), ("replicas", rank, -1, (rank,)))
    out["alone"] = alone
    try:
        comm.all_reduce(alone, (0, 2) if rank != 1 else (1, 2), "undeclared")
    except StageCommError as exc:
        out["undeclared"] = str(exc)
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_all_reduce_sums_or_averages_over_each_group() -> None:
    results = run_ranks(_three_ranks, 3)
    for rank in (0, 1):
        a, b, c = results[rank]["pair"]
        assert torch.equal(a, torch.full((3, 2), 3.0))
        assert torch.equal(b, torch.arange(4) * 10**12 * 3)
        assert c.dtype == torch.float64 and c.item() == 2.0
    assert "pair" not in results[2]
    for rank, out in enumerate(results):
        assert torch.equal(out["everyone"][0], torch.full((5,), 3.0))
        assert torch.equal(out["base"], torch.arange(6.0).reshape(2, 3) * 6)
        assert torch.equal(out["mean"][0], torch.full((2,), 1.0))
        assert torch.equal(out["mean"][1], torch.full((1,), 2.0, dtype=torch.float64))
        assert torch.equal(out["alone"][0], torch.full((2,), 3.0 + rank))
        assert torch.equal(out["large"][0], torch.full((300_000,), 2.0))
        assert torch.equal(out["large"][1], torch.full((3,), 1.5))
        assert torch.equal(out["large"][2], torch.arange(360_000.0).reshape(600, 600).t() * 2)
        # every rank adds the parts in rank order: the same bits everywhere
        assert torch.equal(out["rounding"], torch.tensor([1e8]) + 1.0 - 1e8)
        assert "not one of the groups" in out["undeclared"]


def _dying_peer(rank: int, world_size: int, init_file: str) -> dict:
    init_process_group(rank, world_size, init_file=init_file, backend="gloo", timeout_s=60)
    comm = DistributedComm(rank, [(0, 1)], timeout_s=10, device=torch.device("cpu"))
    channel = [Channel(1, 2, "x", shape=("batch",), dtype="float32")]
    back = [Channel(1, 2, "x", shape=("batch",), dtype="float32", requires_grad=True)]
    if rank == 1:
        comm.send(0, ("act", 0, 1, 2), [torch.ones(2)], channel, 2)
        comm.flush()
        os._exit(1)  # abruptly: no goodbye, the sockets close
    out = {}
    comm.send(1, ("grad", 0, 2, 1), [torch.ones(2)], back, 2)  # rank 1 never receives it
    out["first"] = comm.recv(1, ("act", 0, 1, 2), channel, 2)
    start = time.monotonic()
    for name, wait in [
        ("recv", lambda: comm.recv(1, ("act", 1, 1, 2), channel, 2)),
        ("flush", comm.flush),
        ("all_reduce", lambda: comm.all_reduce([torch.ones(3)], (0, 1), ("replicas", 0, 0))),
        ("send", lambda: comm.send(1, ("grad", 1, 2, 1), [torch.ones(2)], back, 2)),
    ]:
        try:
            wait()
        except PipelineTimeoutError as exc:
            out[name] = str(exc)
    out["seconds"] = time.monotonic() - start
    return out


def test_a_dead_peer_raises_pipeline_timeout_error() -> None:
    survivor, dead = run_ranks(_dying_peer, 2, allow_failures=True, timeout_s=60)
    assert dead.error == "exit" and dead.message == "exit code 1"
    assert survivor.ok, survivor.traceback
    out = survivor.value
    assert torch.equal(out["first"][0], torch.ones(2))
    assert "rank 0" in out["recv"] and "rank 1" in out["recv"]
    assert "act of microbatch 1 (stage 1 -> 2)" in out["recv"]
    assert "rank 1" in out["flush"] and "grad of microbatch 0 (stage 2 -> 1)" in out["flush"]
    assert "rank 1" in out["send"] and "rank 0" in out["send"]
    assert "rank 0 gave up all-reducing ('replicas', 0, 0) with ranks [0, 1]" in out["all_reduce"]


def _misbehaving(rank: int, world_size: int, init_file: str, sleeper: int) -> int:
    if rank == sleeper:
        time.sleep(600)
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


def test_run_ranks_reports_a_failing_rank_and_kills_the_others() -> None:
    with pytest.raises(RankFailed, match=r"(?s)rank 1 raised ValueError: .*on purpose.*Traceback"):
        run_ranks(_misbehaving, 3, 2, timeout_s=60)  # rank 2 sleeps: killed, not waited for
    with pytest.raises(RankFailed, match=r"ranks \[0\] did not finish within 3 s"):
        run_ranks(_misbehaving, 1, 0, allow_failures=True, timeout_s=3)


def test_metadata_encoding_keeps_python_types_and_rejects_others() -> None:
    for value in METADATA:
        back = decode_value(encode_value(value))
        assert type(back) is type(value) and back == value
    assert decode_value(encode_value((torch.Size([1]), [torch.int64]))) == (
        torch.Size([1]),
        [torch.int64],
    )
    with pytest.raises(StageCommError, match="cannot send a dict"):
        encode_value({"a": 1})
    with pytest.raises(StageCommError, match="unknown tag"):
        decode_value(b'{"pickle": 1}')
    with pytest.raises(StageCommError, match="unknown tag"):
        decode_value(b'{"dtype": "load"}')
    # the receiver's device stands in for a device of its kind (cuda:0 sent to cuda:1's rank)
    sent = encode_value((torch.device("cuda", 0), [torch.device("cpu")]))
    here = torch.device("cuda", 1)
    assert decode_value(sent, local=here) == (here, [torch.device("cpu")])
    assert decode_value(sent) == (torch.device("cuda", 0), [torch.device("cpu")])


def test_tags_fit_in_31_bits_and_differ_per_key() -> None:
    keys = [(s, mb, src, src + 1) for s in ("act", "grad") for mb in range(50) for src in range(4)]
    tags = [message_tag(k) for k in keys]
    assert len(set(tags)) == len(keys)
    assert all(0 <= t < 2**31 for t in tags + [message_tag(("act", 2**30, 63, 63))])
