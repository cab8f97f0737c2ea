"""Measure what the simulator needs to know of a cluster that a profile does not say: the link's
latency and bandwidth and the runtime's own costs (`RuntimeCosts`), on a pair of ranks (0 and
1 by default; `runtime/cluster_measure.py` picks pairs per level of a measured cluster).

Every rank of an initialised process group calls `calibrate`; the pair measures, with the
runtime's own `DistributedComm` and the same kind of tensors and optimizer the pipeline uses:

- a message's host costs: how long `send` (packing, posting) takes right after 2 ms of compute
  on both ranks, as every send of a pipeline follows a forward or a backward, and `recv` of a
  message that has already arrived (waiting on it, unpacking), for a tiny message;
- latency: half a tiny message's round trip less the host costs of an idle send and receive;
- bandwidth: the extra one-way time of a `PROBE_BYTES` message over a tiny one, less packing
  the extra bytes at the cache bandwidth;
- a collective's fixed cost: an all-reduce of two numbers over ranks 0 and 1 (the runtime's
  `all_reduce`), less its two latencies;
- a collective's bandwidth: `PROBE_BYTES` over the time an all-reduce of that many bytes takes
  beyond the fixed cost and latencies (what gloo's own reduction and copies allow, which can be
  less than the link's);
- memory bandwidth: bytes read and written per second by a clone of `PROBE_BYTES` right after
  the caches were overwritten (`passes.timing.cache_evictor`: they hold other data, as the
  weights after a step's compute);
- cache bandwidth: the same clone repeated at once (its data in cache, as freshly computed
  gradients and activations);
- per-tensor overhead: the mean per tensor of the runtime's three per-tensor operations over
  `TENSORS` tiny parameters: the optimizer's step, a weight copy, a call on the copy
  (`WeightSlots`, less the plain call).

Results are medians over `repeats`; every rank gets the pair's first rank's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdcompile.core.cluster import Cluster, RuntimeCosts
from pdcompile.lowering.staged_program import Channel
from pdcompile.passes.timing import cache_evictor
from pdcompile.runtime.distributed import DistributedComm
from pdcompile.runtime.weight_slots import WeightSlots

PROBE_BYTES = 4 * 2**20
TENSORS = 64
PROBE = Channel(0, 1, "probe", shape=("batch",), dtype="float32")


@dataclass(frozen=True)
class Calibration:
    """Measured seconds and bytes per second (see the module); `cluster(n)` puts them in a flat
    cluster of n devices."""

    latency: float
    bandwidth: float
    send_s: float
    recv_s: float
    memory_bandwidth: float
    cache_bandwidth: float
    tensor_s: float
    collective_s: float = 0.0
    collective_bandwidth: float | None = None

    @property
    def runtime(self) -> RuntimeCosts:
        """The runtime's costs: a receive's `message_s`, a send's `send_s`."""
        return RuntimeCosts(self.memory_bandwidth, self.tensor_s, self.recv_s,
                            self.cache_bandwidth, self.collective_s, self.send_s,
                            self.collective_bandwidth)  # fmt: skip

    def cluster(self, num_devices: int) -> Cluster:
        return Cluster([(num_devices, self.bandwidth, self.latency)], runtime=self.runtime)


def calibrate(
    rank: int,
    device: torch.device,
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    *,
    repeats: int = 20,
    timeout_s: float = 60.0,
    pair: tuple[int, int] = (0, 1),
) -> Calibration:
    """Measure on the ranks of `pair` (every rank calls it); returns the figures of the pair's
    first rank on every rank. Large messages are timed over `max(3, repeats // 4)` repeats (a
    4 MiB message takes 67 ms at 0.5 Gbit/s)."""
    comm = DistributedComm(rank, [pair], timeout_s=timeout_s, device=device)
    try:
        return _calibrate(comm, rank, device, optimizer, repeats, pair)
    finally:
        comm.close()


def _calibrate(
    comm: DistributedComm,
    rank: int,
    device: torch.device,
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    repeats: int,
    pair: tuple[int, int],
) -> Calibration:
    host = torch.tensor(_host(device, optimizer, repeats), dtype=torch.float64, device=device)
    dist.broadcast(host, pair[0])
    memory, cache, tensor_s = host.tolist()
    one_way, idle_send, send, recv = _message(comm, rank, pair, 1, repeats)
    few = max(3, repeats // 4)
    large, _, _, _ = _message(comm, rank, pair, PROBE_BYTES // 4, few)
    latency = max(one_way - idle_send - recv, 0.0)
    extra = large - one_way - 2 * (PROBE_BYTES - 4) / cache  # less packing the extra bytes
    bandwidth = (PROBE_BYTES - 4) / extra if extra > 0 else PROBE_BYTES / large
    collective = max(all_reduce_seconds(comm, rank, pair, repeats, 2) - 2 * latency, 0.0)
    whole = all_reduce_seconds(comm, rank, pair, few, PROBE_BYTES // 8)
    moving = whole - collective - 2 * latency  # a noisy fixed cost may leave nothing: the whole
    collective_bandwidth = PROBE_BYTES / (moving if moving > 0 else whole)
    return Calibration(latency, bandwidth, send, recv, memory, cache, tensor_s, collective,
                       collective_bandwidth)  # fmt: skip


def all_reduce_seconds(
    comm: DistributedComm, rank: int, pair: tuple[int, ...], repeats: int, numel: int
) -> float:
    """Median seconds of an all-reduce of `numel` float64 over the ranks of `pair`, started
    together; on every rank (as its first rank measured it)."""
    both = torch.zeros(numel, dtype=torch.float64, device=comm.device)
    seconds = []
    for i in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        if rank in pair:
            comm.all_reduce([both], pair, ("calibration", i))
        seconds.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(seconds[2:])], dtype=torch.float64,
                          device=comm.device)  # fmt: skip
    dist.broadcast(median, pair[0])
    return float(median[0])


def _message(
    comm: DistributedComm, rank: int, pair: tuple[int, int], rows: int, repeats: int
) -> tuple[float, ...]:
    """(one-way seconds, the sender's time in `send` idle and right after compute, the
    receiver's in `recv` once the message is there) of a message of `rows` float32 values from
    the pair's first rank to its second (and back), on every rank."""
    first, second = pair
    active = rank in pair
    peer = second if rank == first else first
    payload = [torch.zeros(rows, device=comm.device)]
    trips, sends, busy_sends, recvs = [], [], [], []
    for i in range(repeats + 2):  # two untimed rounds first
        ping, pong, waited = ("act", i, 0, 1), ("grad", i, 0, 1), ("wait", i, 0, 1)
        if active:
            comm.expect(peer, pong if rank == first else ping, [PROBE], rows)
        dist.barrier()
        start = time.perf_counter()
        if rank == first:
            comm.send(peer, ping, payload, [PROBE], rows)
            sends.append(time.perf_counter() - start)
            comm.recv(peer, pong, [PROBE], rows)
            trips.append(time.perf_counter() - start)
        elif rank == second:
            comm.recv(peer, ping, [PROBE], rows)
            comm.send(peer, pong, payload, [PROBE], rows)
        # a receive that finds its message there (the second rank waits until it surely arrived)
        if rank == second:
            comm.expect(peer, waited, [PROBE], rows)
        dist.barrier()
        if rank == first:
            comm.send(peer, waited, payload, [PROBE], rows)
            comm.flush()
        dist.barrier()
        if rank == second:
            time.sleep(0.002)
            start = time.perf_counter()
            comm.recv(peer, waited, [PROBE], rows)
            recvs.append(time.perf_counter() - start)
        comm.flush()
        busy = ("busy", i, 0, 1)  # a send right after compute, as in a pipeline
        if rank == second:
            comm.expect(peer, busy, [PROBE], rows)
        dist.barrier()
        if active:
            _compute(comm.device, 0.002)
        if rank == first:
            start = time.perf_counter()
            comm.send(peer, busy, payload, [PROBE], rows)
            busy_sends.append(time.perf_counter() - start)
        elif rank == second:
            comm.recv(peer, busy, [PROBE], rows)
        comm.flush()
    figures = [statistics.median(trips[2:]) / 2 if trips else 0.0,
               statistics.median(sends[2:]) if sends else 0.0,
               statistics.median(busy_sends[2:]) if busy_sends else 0.0,
               statistics.median(recvs[2:]) if recvs else 0.0]  # fmt: skip
    both = torch.tensor(figures, dtype=torch.float64, device=comm.device)
    dist.all_reduce(both)  # each figure was measured on one rank, the others give 0
    return tuple(both.tolist())


def _host(
    device: torch.device,
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    repeats: int,
) -> list[float]:
    """[memory bandwidth, cache bandwidth, per-tensor seconds] of this rank."""
    data = torch.ones(PROBE_BYTES // 4, device=device)
    evict = cache_evictor(device)
    cold, hot = [], []
    for _ in range(repeats + 2):
        evict()
        cold.append(timed(device, data.clone))
        hot.append(timed(device, data.clone))
    del evict
    modules = torch.nn.Sequential(*(torch.nn.Linear(1, 1, bias=False) for _ in range(TENSORS)))
    modules.to(device)
    params = dict(modules.named_parameters())
    for p in params.values():
        p.grad = torch.ones_like(p)
    x = torch.ones(1, 1, device=device)
    copies = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    slots = WeightSlots(modules)
    per_tensor = [
        _median(device, optimizer(list(params.values())).step, repeats),
        _median(device, lambda: {n: p.detach().clone().requires_grad_() for n, p in params.items()},
                repeats),
        _median(device, lambda: slots(copies, (x,), {}), repeats)
        - _median(device, lambda: modules(x), repeats),
    ]  # fmt: skip
    copy = 2 * PROBE_BYTES
    tensor_s = max(statistics.mean(per_tensor), 0.0) / TENSORS
    return [copy / statistics.median(cold[2:]), copy / statistics.median(hot[2:]), tensor_s]


def _compute(device: torch.device, seconds: float) -> None:
    """Matrix products for about `seconds`, as a stage's forward or backward."""
    a = torch.ones(256, 256, device=device)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        timed(device, lambda: a @ a)


def _median(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs, after two untimed ones."""
    return statistics.median([timed(device, fn) for _ in range(repeats + 2)][2:])


def timed(device: torch.device, fn: Callable[[], object]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
