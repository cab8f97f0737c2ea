"""How a rank talks to the others: messages of channel values, and all-reduces.

A message carries the values of the channels from one stage to another for one microbatch (or
their gradients), in the order of `program.channels`. Every value is checked against its
channel: a tensor with another shape or dtype raises `StageCommError` naming the channel, both
ranks and both shapes.

`LocalComm` passes messages within one process (the local executor); `DistributedComm`
(`runtime/distributed.py`) uses torch.distributed point-to-point operations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pdcompile.core.errors import StageCommError
from pdcompile.lowering.staged_program import Channel

Key = tuple[str, int, int, int]  # (stream "act"/"grad", microbatch, source stage, dest stage)


class Comm(Protocol):
    """One rank's communication. `send` never blocks; `recv` waits (with the executor's timeout)."""

    rank: int

    def send(
        self, peer: int, key: Key, values: Sequence[Any], channels: Sequence[Channel], rows: int
    ) -> None:
        """Send the values of `channels` for a microbatch of `rows` rows."""
        ...

    def recv(self, peer: int, key: Key, channels: Sequence[Channel], rows: int) -> list[Any]:
        """Wait for them (posted early if `expect` was called)."""
        ...

    def expect(self, peer: int, key: Key, channels: Sequence[Channel], rows: int) -> None:
        """A receive that will come: post it now if the backend allows."""
        ...

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        group: tuple[int, ...],
        key: Any,
        average: bool = False,
    ) -> None:
        """Sum (or average) `tensors` in place over the ranks of `group` (every member calls
        it; the result may land only when the last member has called)."""
        ...

    def start_all_reduce(
        self, tensors: Sequence[torch.Tensor], group: tuple[int, ...], key: Any
    ) -> Callable[[], None]:
        """Start summing `tensors` in place over the ranks of `group`; the returned function
        waits until this rank has the sum (leave the tensors alone until then)."""
        ...

    def flush(self) -> None:
        """Wait until every message sent so far has been received."""
        ...


def check_value(value: Any, channel: Channel, src: int, dst: int) -> None:
    """Raise `StageCommError` unless `value` fits `channel` (any size along batch dimensions)."""
    if channel.kind != "tensor":
        return
    where = f"channel {channel.name!r} (stage {channel.src_stage} -> {channel.dst_stage})"
    if not isinstance(value, torch.Tensor):
        raise StageCommError(
            f"{where}: rank {src} sent {type(value).__name__} to rank {dst}, which expects a "
            f"tensor {channel.describe()}"
        )
    expected = channel.shape
    fits = len(value.shape) == len(expected) and all(
        isinstance(want, str) or got == want
        for got, want in zip(value.shape, expected, strict=True)
    )
    dtype = str(value.dtype).removeprefix("torch.")
    if not fits or dtype != channel.dtype:
        raise StageCommError(
            f"{where}: rank {src} sent {dtype}{list(value.shape)} to rank {dst}, which expects "
            f"{channel.describe()}; the sender's stage computes another shape than the one "
            "captured (a different sequence length or dtype?)"
        )


def gradient_channels(channels: Sequence[Channel]) -> list[Channel]:
    """The channels whose gradients travel back, as channels of the gradient message."""
    return [c for c in channels if c.kind == "tensor" and c.requires_grad]


@dataclass
class LocalComm:
    """Messages between ranks in one process: a shared mailbox, no copies but detached values."""

    rank: int
    mailbox: dict[tuple[int, int, Key], list[Any]] = field(default_factory=dict)
    pending: dict[Any, list[Sequence[torch.Tensor]]] = field(default_factory=dict)

    def for_rank(self, rank: int) -> LocalComm:
        """The same mailbox, seen from another rank."""
        return LocalComm(rank, self.mailbox, self.pending)

    def has(self, peer: int, key: Key) -> bool:
        return (peer, self.rank, key) in self.mailbox

    def send(
        self, peer: int, key: Key, values: Sequence[Any], channels: Sequence[Channel], rows: int
    ) -> None:
        detached = [v.detach() if isinstance(v, torch.Tensor) else v for v in values]
        self.mailbox[(self.rank, peer, key)] = detached

    def expect(self, peer: int, key: Key, channels: Sequence[Channel], rows: int) -> None:
        """Nothing to post: the mailbox holds messages until they are read."""

    def recv(self, peer: int, key: Key, channels: Sequence[Channel], rows: int) -> list[Any]:
        values = self.mailbox.pop((peer, self.rank, key))
        for value, channel in zip(values, channels, strict=True):
            check_value(value, channel, peer, self.rank)
        return values

    def flush(self) -> None:
        """Nothing to wait for: a message is in the mailbox as soon as it is sent."""

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        group: tuple[int, ...],
        key: Any,
        average: bool = False,
    ) -> None:
        """Collects every member's tensors; the last member to arrive reduces them into all."""
        arrived = self.pending.setdefault((key, group), [])
        arrived.append(tensors)
        if len(arrived) < len(group):
            return
        del self.pending[(key, group)]
        for parts in zip(*arrived, strict=True):
            total = torch.stack(parts).sum(dim=0)
            if average:
                total /= len(group)
            for p in parts:
                p.copy_(total)

    def start_all_reduce(
        self, tensors: Sequence[torch.Tensor], group: tuple[int, ...], key: Any
    ) -> Callable[[], None]:
        """As `all_reduce`: the sum lands in every member's tensors when the last one starts
        (the local executor runs a collective's members before any goes past it)."""
        self.all_reduce(tensors, group, key)
        return _nothing


def _nothing() -> None:
    """Nothing left to wait for."""
