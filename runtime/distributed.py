"""`DistributedComm`: stage messages and all-reduces over torch.distributed (gloo or NCCL).

A message (the values of the channels for one `Key`) is one non-blocking point-to-point
operation of one byte buffer (`runtime/wire.py`), under a tag derived from the key. Both ends
know its layout from the channels and the microbatch's rows, so receives are posted early
(`expect`) and the sender checks the values against their channels. Sends never wait for the
receiver; their handles are kept until the executor knows the receive is posted (`settle`) or
`flush` waits for them all. On gloo the tags keep messages apart; NCCL ignores tags and matches
the operations between two ranks in order, which holds by construction: both walk one validated
schedule. Every wait has a timeout; a timeout or a failure of the backend (a dead peer)
becomes a `PipelineTimeoutError` naming this rank, the peer ranks and what it waited on. The wire
format, the tags and the timeouts are described in docs/runtime.md ("Communication").
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import warnings
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.core.errors import PipelineTimeoutError, StageCommError
from pdcompile.lowering.staged_program import Channel
from pdcompile.passes.planning.action_costs import COALESCE_MAX_BYTES
from pdcompile.runtime import heartbeat, host_heap, wire
from pdcompile.runtime.bounded import collective
from pdcompile.runtime.comm import Key, LocalComm
from pdcompile.runtime.message_pool import MessagePool
from pdcompile.runtime.watchdog import peers, start_watchdog

__all__ = ["DistributedComm", "init_process_group", "message_tag"]

logger = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"
_DEFAULT_PORT = 29500  # torch's
_STREAMS = {"act": 0, "grad": 1}
LINGER_S = 2.0  # how long a failing rank waits for its error messages to be delivered
EXCHANGE_MAX = 4  # on gloo, groups up to this size all-reduce by exchanging whole tensors...
# ...of at most this many bytes: measured on 2 gloo ranks here, the exchange took 2.9 ms for 1 MB
# (gloo's all-reduce 2.8 ms) and 97.4 ms for 34 MB (gloo's 34.3 ms)
EXCHANGE_MAX_BYTES = 2**20


def init_process_group(
    rank: int,
    world_size: int,
    *,
    init_file: str | None = None,
    backend: str | None = None,
    timeout_s: float,
) -> torch.device:
    """Join the default process group; return the device this rank's tensors live on.

    Args:
        backend: "nccl" when CUDA is available, else "gloo", unless given.
        init_file: a `FileStore` path shared by the ranks (tests); None reads the `MASTER_ADDR`,
            `MASTER_PORT` variables that `torchrun` sets. Without `MASTER_ADDR` the ranks meet on
            this machine's loopback address (port `MASTER_PORT`, else 29500): the rendezvous
            never listens on a network unless the user names an address.
        timeout_s: the default timeout of every operation of the group.
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK") or rank % torch.cuda.device_count())
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    store = _store(rank, world_size, init_file, timeout)
    dist.init_process_group(
        backend,
        init_method=None if store is not None else "env://",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    logger.info("rank %d: joined a %s group of %d ranks on %s", rank, backend, world_size, device)
    return device


def _store(rank: int, world_size: int, init_file: str | None, timeout: timedelta) -> Any:
    """The rendezvous store: a `FileStore`, None for `env://` (`MASTER_ADDR` given: torchrun or
    the user chose the address), else a `TCPStore` listening on the loopback address only (a
    `TCPStore` given an address still listens on every interface)."""
    if init_file is not None:
        return dist.FileStore(init_file, world_size)
    if os.environ.get("MASTER_ADDR"):
        return None
    port = int(os.environ.get("MASTER_PORT") or _DEFAULT_PORT)
    listen_fd = None
    if rank == 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((_LOOPBACK, port))
        except OSError as exc:
            sock.close()
            raise StageCommError(
                f"rank 0 cannot listen on {_LOOPBACK}:{port} for the rendezvous ({exc.strerror}): "
                "set MASTER_PORT to a free port (or MASTER_ADDR to rendezvous over a network)"
            ) from exc
        sock.listen()
        listen_fd = sock.detach()  # the store owns the socket from here
    return dist.TCPStore(
        _LOOPBACK, port, world_size, rank == 0, timeout, master_listen_fd=listen_fd
    )


def message_tag(key: Key) -> int:
    """The point-to-point tag of a message: 31 bits of the key, unique among messages in flight.

    Bits: microbatch mod 2^18, stream (3 bits), source and destination stage mod 32 (5 bits each).
    """
    stream, microbatch, src, dst = key
    stream_code = _STREAMS.get(stream, 2 + zlib.crc32(stream.encode()) % 6)
    return (microbatch % (1 << 18)) << 13 | stream_code << 10 | (src % 32) << 5 | dst % 32


def describe_key(key: Key) -> str:
    """`act of microbatch 3 (stage 0 -> 1)`."""
    stream, microbatch, src, dst = key
    return f"{stream} of microbatch {microbatch} (stage {src} -> {dst})"


class DistributedComm:
    """One rank's `Comm` over an initialised default process group.

    Args:
        rank: this rank.
        groups: every rank group an all-reduce will use, the same list in the same order on every
            rank (each becomes a process group here: a collective call).
        timeout_s: how long any wait lasts before it raises `PipelineTimeoutError`.
        device: where received tensors are put: the CPU for gloo, this rank's GPU for NCCL.
    """

    def __init__(
        self,
        rank: int,
        groups: Sequence[tuple[int, ...]],
        *,
        timeout_s: float,
        device: torch.device,
    ) -> None:
        self.rank = rank
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self._timeout = timedelta(seconds=timeout_s)
        # messages travel in groups of their own: another pipeline in the same job (or an
        # earlier one with minibatches still in flight) never matches them. One group carries
        # the messages to higher ranks, one those to lower ranks: on gloo a pair of ranks then
        # talks over two connections, one per direction, and a send no longer shares its
        # connection with the peer's messages coming the other way (an MLP's sends took 0.9 ms
        # each in the pipeline with one connection, 0.3 ms with two: docs/runtime.md).
        self._p2p: list[Any] = []
        self._groups: dict[tuple[int, ...], Any] = {}  # None: a group without this rank
        # making a group meets through the store, which gloo does not bound: `timeout_s` does
        collective(rank, "creating process groups", lambda: self._make_groups(groups), timeout_s,
                   culprit="failed before creating them")  # fmt: skip
        # (work, tensor, peer, what, key) of sends not known to be complete, oldest first. gloo
        # completes a send only once its receive is posted, and says so only to a `wait`: the
        # executor waits on those it knows posted (`settle`); NCCL's are polled at each send.
        self._sends: deque[tuple[Any, torch.Tensor, int, str, Key]] = deque()
        self._gloo = dist.get_backend() == "gloo"
        # buffers of failed waits: the backend may still write into them, so they stay alive
        self._abandoned: list[tuple[Any, torch.Tensor]] = []
        # error messages sent in place of owed ones, not yet known to be delivered (`linger`)
        self._told: list[tuple[Any, torch.Tensor]] = []
        # receives posted early (`expect`), by (peer, key)
        self._posted: dict[tuple[int, Key], tuple[Any, torch.Tensor, wire.Layout, str]] = {}
        # the wait in progress (what, peer, since), which a watchdog thread reports every
        # `watchdog_s` while it lasts: a hang shows in the log long before the timeout
        self._waiting: tuple[str, Any, float] | None = None
        self._closed = threading.Event()
        self.watchdog_s = min(60.0, max(1.0, timeout_s / 5))
        heartbeat.start(rank)  # signs of life, read by a rank that times out
        self._watchdog: threading.Thread | None = None
        # messages between two stages of this rank: handed over, never on the wire
        self._own = LocalComm(rank)
        # message buffers reused on the CPU (glibc's heap grew by ~250 MiB a rank with a fresh
        # buffer per message: runtime/message_pool.py); CUDA's caching allocator reuses its own
        self._pool = MessagePool() if self.device.type == "cpu" else None
        if self.device.type == "cpu":  # freed gradient temporaries go back to the system
            host_heap.return_freed_memory()
        # a comm collected unclosed still releases its groups (a loop of compiles that never
        # closes ran out of descriptors after ~40); close() runs the same release at once.
        # Not at exit: the process releases everything then, and the default group may be gone
        groups = [g for g in [*self._p2p, *self._groups.values()] if g is not None]
        self._release = weakref.finalize(self, _release, rank, groups, self._closed, True)
        self._release.atexit = False

    def _make_groups(self, groups: Sequence[tuple[int, ...]]) -> None:
        world = list(range(dist.get_world_size()))
        self._p2p = [dist.new_group(world, timeout=self._timeout) for _ in range(2)]
        for group in groups:
            members = tuple(sorted(group))
            if members not in self._groups:
                handle = dist.new_group(list(members), timeout=self._timeout)
                self._groups[members] = handle if self.rank in members else None

    def expect(self, peer: int, key: Key, channels: Sequence[Channel], rows: int) -> None:
        """Post the receive of a message now, so that its sender's send completes as soon as
        the bytes have moved (gloo).

        On NCCL receives are posted when `recv` is called: the point-to-point operations of a
        pair of ranks share a stream, and a receive posted early would hold up the sends behind
        it.
        """
        if not self._gloo or (peer, key) in self._posted or peer == self.rank:
            return
        self._posted[(peer, key)] = self._post(peer, key, channels, rows)

    def send(
        self, peer: int, key: Key, values: Sequence[Any], channels: Sequence[Channel], rows: int
    ) -> None:
        """Post the message of `values` to `peer`; returns without waiting for the receiver.

        Raises:
            StageCommError: a value does not fit its channel, or cannot be packed (the
                receiver is told and raises the same error).
        """
        if peer == self.rank:
            self._own.send(peer, key, values, channels, rows)
            return
        lay = wire.layout(tuple(channels), rows)
        tag, what = message_tag(key), f"sending {describe_key(key)}"
        try:
            out = self._pool.take(lay.size) if self._pool is not None else None
            buffer, error = wire.pack(values, lay, key, self.device, self.rank, peer, out)
            if out is not None and buffer is not out:  # an error message instead
                self._pool.give(out)
        except Exception as exc:  # the peer waits for this message: it gets the error instead
            error = StageCommError(
                f"rank {self.rank} could not pack its {describe_key(key)} for rank {peer}: "
                f"{type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            buffer = wire.error_message(lay, key, str(error), self.device)
        group = self._p2p[peer > self.rank]
        work = self._start(dist.isend, buffer, peer, what, dst=peer, tag=tag, group=group)
        self._sends.append((work, buffer, peer, what, key))
        while not self._gloo and self._sends and self._sends[0][0].is_completed():
            self._wait(*self._sends.popleft()[:4])  # raises if it failed
        logger.debug("rank %d: %s to rank %d", self.rank, what, peer)
        if error is not None:
            raise error

    def send_error(
        self,
        peer: int,
        key: Key,
        channels: Sequence[Channel],
        rows: int,
        text: str,
        timeout: bool = False,
    ) -> None:
        """Send `text` in place of the message of `key` (the peer raises `StageCommError` with
        it, or `PipelineTimeoutError` if `timeout`: a relayed timeout or dead peer). Best effort:
        the run is failing already, and the peer may be gone too."""
        if peer == self.rank:  # the rank itself is failing: nothing waits on it
            return
        try:
            lay = wire.layout(tuple(channels), rows)
            buffer = wire.error_message(lay, key, text, self.device, timeout)
            group = self._p2p[peer > self.rank]
            work = dist.isend(buffer, dst=peer, tag=message_tag(key), group=group)
        except Exception as exc:  # never mask the error being reported
            logger.warning("rank %d: could not tell rank %d: %s", self.rank, peer, exc)
            return
        self._told.append((work, buffer))

    def linger(self, within_s: float = LINGER_S) -> None:
        """Give the error messages `send_error` started up to `within_s` in all to reach peers
        that wait for them, before this rank's process may exit and close its connections (a
        peer would then hear of a closed connection instead of the error). Best effort."""
        deadline = time.monotonic() + within_s
        told, self._told = self._told, []
        for work, buffer in told:
            left = deadline - time.monotonic()
            try:
                if left <= 0 or work.wait(timeout=timedelta(seconds=left)) is False:
                    self._abandoned.append((work, buffer))
            except Exception:  # the peer is gone too: nothing to tell
                self._abandoned.append((work, buffer))

    def recv(self, peer: int, key: Key, channels: Sequence[Channel], rows: int) -> list[Any]:
        """Wait for the message of `key` from `peer` (posted by `expect`, or now).

        Raises:
            StageCommError: the sender found a value that does not fit its channel, or the
                message is not the one expected.
            PipelineTimeoutError: nothing arrived within the timeout, or the peer died.
        """
        if peer == self.rank:
            return self._own.recv(peer, key, channels, rows)
        posted = self._posted.pop((peer, key), None) or self._post(peer, key, channels, rows)
        work, buffer, lay, what = posted
        self._wait(work, buffer, peer, what)
        values = wire.unpack(buffer, lay, key)
        if self._pool is not None:  # the stage keeps the values: copied out of the reused buffer
            values = [v.clone() if isinstance(v, torch.Tensor) else v for v in values]
            self._pool.give(buffer)
        logger.debug("rank %d: %s from rank %d", self.rank, what, peer)
        return values

    def _post(
        self, peer: int, key: Key, channels: Sequence[Channel], rows: int
    ) -> tuple[Any, torch.Tensor, wire.Layout, str]:
        lay = wire.layout(tuple(channels), rows)
        if self._pool is not None:
            buffer = self._pool.take(lay.size)
        else:
            buffer = torch.empty(lay.size, dtype=torch.uint8, device=self.device)
        what = f"receiving {describe_key(key)}"
        tag = message_tag(key)
        group = self._p2p[self.rank > peer]
        work = self._start(dist.irecv, buffer, peer, what, src=peer, tag=tag, group=group)
        return work, buffer, lay, what

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        group: tuple[int, ...],
        key: Any,
        average: bool = False,
    ) -> None:
        """Sum (or average) `tensors` in place over the ranks of `group`: one all-reduce per
        tensor of over `COALESCE_MAX_BYTES`, one per dtype of the others flattened together.

        Returns when this rank has the result (a group of one rank returns at once).
        """
        self.start_all_reduce(tensors, group, key, average)()

    def start_all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        group: tuple[int, ...],
        key: Any,
        average: bool = False,
    ) -> Callable[[], None]:
        """Start `all_reduce` without waiting: every reduction is posted at once, and the
        returned function waits for them (with the timeout) and completes the tensors. Leave
        them alone until then (`runtime/grad_buckets.py` starts buckets from the backward)."""
        members = tuple(sorted(group))
        handle = self._groups.get(members)
        if handle is None:
            raise StageCommError(
                f"rank {self.rank}: all-reduce {key} over ranks {members}, which is not one of the "
                f"groups this rank belongs to ({sorted(self._groups)}); pass every group to "
                "DistributedComm on every rank"
            )
        if len(members) == 1 or not tensors:
            return _done
        # a large tensor in place: flattening it would copy it twice through a fresh buffer, whose
        # first touch faults a page per 4 KiB (34 MB: 26 ms to flatten, 28 ms to all-reduce here)
        whole, by_dtype = [], {}
        for t in tensors:
            if t.nbytes > COALESCE_MAX_BYTES and t.is_contiguous() and t.device == self.device:
                whole.append(t)
            else:
                by_dtype.setdefault(t.dtype, []).append(t)
        what = f"all-reducing {key}"
        finishes = []
        with torch.no_grad():
            for tensor in whole:
                work = self._start(dist.all_reduce, tensor, members, what, group=handle,
                                   async_op=True)  # fmt: skip
                finishes.append((tensor, None, [(work, tensor)]))
            for parts in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in parts]).to(self.device)
                small = flat.nbytes <= EXCHANGE_MAX_BYTES
                if self._gloo and len(members) <= EXCHANGE_MAX and small:
                    works, theirs = self._start_exchange(flat, members, handle, what)
                    finishes.append((flat, parts, works, theirs))
                else:
                    work = self._start(dist.all_reduce, flat, members, what, group=handle,
                                       async_op=True)  # fmt: skip
                    finishes.append((flat, parts, [(work, flat)]))

        def wait() -> None:
            with torch.no_grad():
                for flat, parts, works, *theirs in finishes:
                    for work, tensor in works:
                        self._wait(work, tensor, members, what)
                    if theirs:  # the exchange: every member adds the same parts in rank order
                        flat = _rank_ordered_sum(flat, theirs[0], members, self.rank)
                    if average:
                        flat /= len(members)
                    offset = 0
                    for part in parts or ():
                        part.copy_(flat[offset : offset + part.numel()].view_as(part))
                        offset += part.numel()

        return wait

    def _start_exchange(
        self, flat: torch.Tensor, members: tuple[int, ...], group: Any, what: str
    ) -> tuple[list[tuple[Any, torch.Tensor]], dict[int, torch.Tensor]]:
        """Start the exchange that sums `flat` over `members`: each member sends its tensor to
        every other, and (`_rank_ordered_sum`, once the works are done) adds them all in rank
        order, so every member gets the same bits. On gloo this is one message each way:
        0.27-0.30 ms for a 64 KiB tensor between two ranks here, where gloo's all-reduce took
        0.40-1.65 ms (`benchmarks/allreduce.py`)."""
        peers = [m for m in members if m != self.rank]
        theirs = {m: torch.empty_like(flat) for m in peers}
        works = [(self._start(dist.irecv, theirs[m], members, what, src=m, group=group), theirs[m])
                 for m in peers]  # fmt: skip
        works += [(self._start(dist.isend, flat, members, what, dst=m, group=group), flat)
                  for m in peers]  # fmt: skip
        return works, theirs

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the message buffers held: receives posted and not yet read, sends not known
        complete (the memory probe's message buffers, `runtime/memory_probe.py`)."""
        posted = sum(buffer.nbytes for _, buffer, _, _ in self._posted.values())
        return posted + sum(send[1].nbytes for send in self._sends)

    @property
    def pending_sends(self) -> int:
        """How many posted sends (parts of messages) are not known to be complete."""
        return len(self._sends)

    def settle(self, posted: Callable[[int, Key], bool]) -> None:
        """Wait for the sends whose receives have been posted (`posted(peer, key)`: the peer
        has reached them in its schedule), releasing their buffers; the others stay pending. The
        waits are short: a posted receive completes its send as soon as the bytes have moved."""
        pending = self._sends
        self._sends = deque()
        try:
            while pending:
                send = pending.popleft()
                if posted(send[2], send[4]):
                    self._wait(*send[:4])
                    if self._pool is not None:  # complete: the buffer is free again
                        self._pool.give(send[1])
                else:
                    self._sends.append(send)
        finally:
            self._sends.extend(pending)  # after a failure, the rest stay pending

    def flush(self) -> None:
        """Wait until every message sent so far has been received (`timeout_s` per send)."""
        self.settle(lambda peer, key: True)

    def close(self) -> None:
        """Wait for the messages sent, then release the comm's process groups: their
        connections and threads (14 threads and 20 descriptors per pipeline on gloo, which a
        process compiling again and again ran out of). The comm is unusable afterwards."""
        if self._closed.is_set():
            return
        self.flush()
        self._release.detach()
        _release(self.rank, [*self._p2p, *self._groups.values()], self._closed, False)

    def _start(self, op: Any, tensor: torch.Tensor, peer: Any, what: str, **kwargs: Any) -> Any:
        if self._closed.is_set():
            raise StageCommError(
                f"rank {self.rank}: {what} after the pipeline was closed; compile the model "
                "again to train on"
            )
        try:
            return op(tensor, **kwargs)
        except RuntimeError as exc:
            raise self._failure(peer, what, exc) from exc

    def _wait(self, work: Any, tensor: torch.Tensor, peer: Any, what: str) -> None:
        start = time.monotonic()
        self._waiting = (what, peer, start)
        self._start_watchdog()
        try:
            if work.wait(timeout=self._timeout) is False:
                raise RuntimeError("the operation was aborted")
        except RuntimeError as exc:  # timeouts and dead peers (DistBackendError, ...) alike
            self._abandoned.append((work, tensor))
            raise self._failure(peer, what, exc, time.monotonic() - start) from exc
        finally:
            self._waiting = None

    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = start_watchdog(self)

    def _failure(
        self, peer: Any, what: str, exc: BaseException, waited: float | None = None
    ) -> PipelineTimeoutError:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        after = "at once" if waited is None else f"after waiting {waited:.1f} s"
        if waited is not None and waited >= 0.9 * self.timeout_s:  # timed out: who stopped?
            reason += heartbeat.stall_note(dist.get_world_size(), self.rank)
        logger.error("rank %d: %s with %s failed %s: %s", self.rank, what, peers(peer), after,
                     reason)  # fmt: skip
        return PipelineTimeoutError(
            f"rank {self.rank} gave up {what} with {peers(peer)} {after} (timeout "
            f"{self.timeout_s:g} s): {reason}; the peer died, hangs, or runs another schedule: "
            "see its own log"
        )


_warned = False  # the ResourceWarning of a comm collected unclosed, once per process


def _release(rank: int, groups: Sequence[Any], closed: threading.Event, collected: bool) -> None:
    """Destroy a comm's process groups (their connections and threads) and end its watchdog;
    when the comm was `collected` unclosed, warn once per process, like an unclosed file.
    Holds no reference to the comm (a `weakref.finalize` callback)."""
    global _warned
    closed.set()
    for group in groups:
        # gone already when the default group was destroyed (it takes every group with it)
        if group is not None and dist.is_initialized() and group in _world_groups():
            dist.destroy_process_group(group)
    if collected and not _warned:
        _warned = True
        warnings.warn(
            f"rank {rank}: a pdcompile pipeline (its DistributedComm) was garbage-collected "
            f"without close(); its {len(groups)} process groups were released then. Call "
            "close() on every rank, or use `with pdcompile.compile(...) as pipe:` (said once)",
            ResourceWarning,
            stacklevel=1,  # the finalizer has no caller of interest
        )


def _world_groups() -> Any:
    """The process groups torch.distributed holds (destroying one twice raises)."""
    return dist.distributed_c10d._world.pg_map


def _done() -> None:
    """Nothing to wait for."""


def _rank_ordered_sum(
    flat: torch.Tensor, theirs: dict[int, torch.Tensor], members: tuple[int, ...], rank: int
) -> torch.Tensor:
    """The sum of this rank's `flat` and the others' (`theirs`), added in rank order."""
    parts = [flat if m == rank else theirs[m] for m in members]
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total
