"""Message buffers are reused from slabs (`runtime/message_pool.py`): what a comm holds stays
bounded by the messages in flight however many pass, and a value received earlier is never
overwritten by a later message in a reused buffer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from spawn import run_ranks

from pdcompile.lowering.staged_program import Channel
from pdcompile.runtime.distributed import DistributedComm, init_process_group
from pdcompile.runtime.message_pool import SLOTS, MessagePool

WIDE = [Channel(0, 1, "h", shape=("batch", 1024), dtype="float32")]  # 64 KiB at 16 rows


def test_the_pool_reuses_its_slots_and_ignores_buffers_it_did_not_give() -> None:
    pool = MessagePool()
    taken = [pool.take(100) for _ in range(SLOTS + 1)]  # a second slab
    assert pool.held_bytes == 2 * SLOTS * 100
    for buffer in taken:
        pool.give(buffer)
    pool.give(torch.empty(100, dtype=torch.uint8))  # not the pool's
    for _ in range(10 * SLOTS):
        pool.give(pool.take(100))
    assert pool.held_bytes == 2 * SLOTS * 100


def _ranks(rank: int, world_size: int, init_file: str) -> dict:
    torch.set_num_threads(1)
    init_process_group(rank, world_size, init_file=init_file, backend="gloo", timeout_s=60)
    comm = DistributedComm(rank, [], timeout_s=30, device=torch.device("cpu"))
    out: dict = {}
    kept = []
    for burst in range(25):  # 200 messages, 8 in flight at a time
        keys = [("act", burst * 8 + i, 0, 1) for i in range(8)]
        if rank == 0:
            for k in keys:
                comm.send(1, k, [torch.full((16, 1024), float(k[1]))], WIDE, 16)
            comm.flush()
        else:
            for k in keys:
                comm.expect(0, k, WIDE, 16)
            kept += [comm.recv(0, k, WIDE, 16)[0] for k in keys]
        dist.barrier()
    out["held"] = comm._pool.held_bytes
    if rank == 1:  # every value as sent, the first ones included
        out["right"] = all(bool((v == i).all()) for i, v in enumerate(kept))
    comm.close()
    dist.destroy_process_group()
    return out


def test_messages_reuse_bounded_buffers_and_received_values_stay_intact() -> None:
    sender, receiver = run_ranks(_ranks, 2, timeout_s=90)
    size = 32 + 16 * 1024 * 4  # preamble and values
    for out in (sender, receiver):
        assert out["held"] <= SLOTS * size, out  # one slab: 8 in flight, not 200 buffers
    assert receiver["right"]
