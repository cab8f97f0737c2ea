"""The wire format of stage messages: one byte buffer per message, laid out from the channels.

Both ends know a message's layout before it travels: the channels between the two stages, in
the order of `program.channels`, at the rows of the microbatch (every rank holds the whole
batch, so both know them). So the receiver posts its receive early, into a buffer of exactly the
message's size, and a message is one point-to-point operation.

Layout: a preamble of 4 int64 (magic, checksum of the key, status, length of an error text),
then each channel's bytes at an 8-aligned offset (16 for complex128, so that the receiver views
them in place): a tensor of the channel's shape at those rows and its dtype, made contiguous on
the way (a strided slice, a transpose, an expanded or conjugated view travels as its values;
bool and complex as their bytes, which gloo carries like any other), or a slot of `VALUE_SLOT`
bytes for metadata (an int64 length, then UTF-8 JSON
with type tags: `{"size": [2, 3]}` is `torch.Size([2, 3])`, so no one unpickles what a peer
sent). The sender checks every value against its channel first; on a mismatch it sends the
message with status 1 and the error's text instead, and raises: both ranks raise the same
`StageCommError`, and the next message between them is unaffected.
"""

from __future__ import annotations

import functools
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdcompile.core.errors import PipelineTimeoutError, StageCommError
from pdcompile.lowering.staged_program import Channel

MAGIC = 0x70646332  # "pdc2"
PREAMBLE = 4  # int64: magic, key checksum, status, error length
VALUE_SLOT = 1024  # bytes for one metadata value, its 8-byte length included
ERROR_ROOM = 1024  # bytes a message keeps for an error text however small its values
_SUPPORTED = "None, bool, int, float, str, torch.Size, torch.dtype, torch.device, tuples and lists"


@dataclass(frozen=True)
class Slot:
    """Where one channel's value sits in a message: `dtype` None for metadata."""

    channel: Channel
    offset: int
    nbytes: int
    dtype: torch.dtype | None
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    slots: tuple[Slot, ...]
    size: int  # bytes


@functools.lru_cache(maxsize=1024)
def layout(channels: tuple[Channel, ...], rows: int) -> Layout:
    """The layout of the message of `channels` for a microbatch of `rows` rows (cached: the
    same few layouts serve every step)."""
    offset, slots = 8 * PREAMBLE, []
    for c in channels:
        if c.kind == "tensor":
            dtype, shape = getattr(torch, c.dtype), c.shape_for(rows)
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            align = max(8, dtype.itemsize)  # a view of the buffer as `dtype` needs it
            offset = -(-offset // align) * align
        else:
            dtype, shape, nbytes = None, (), VALUE_SLOT
        slots.append(Slot(c, offset, nbytes, dtype, shape))
        offset += -(-nbytes // 8) * 8
    return Layout(tuple(slots), max(offset, 8 * PREAMBLE + ERROR_ROOM))


def key_checksum(key: tuple) -> int:
    return zlib.crc32(repr(key).encode())


def pack(
    values: Sequence[Any],
    lay: Layout,
    key: tuple,
    device: torch.device,
    src: int,
    dst: int,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, StageCommError | None]:
    """The message of `values` (in `out`, a buffer of `lay.size` bytes, when given), or, if one
    does not fit its channel, the error message and the error (the sender raises it after
    sending)."""
    error = _mismatch(values, lay, src, dst)
    if error is not None:
        return error_message(lay, key, str(error), device), error
    buffer = torch.empty(lay.size, dtype=torch.uint8, device=device) if out is None else out
    _preamble(buffer, key, status=0, length=0)
    for slot, value in zip(lay.slots, values, strict=True):
        if slot.dtype is None:
            data = encode_value(value)
            buffer[slot.offset : slot.offset + 8] = _bytes(len(data).to_bytes(8, "little"), device)
            buffer[slot.offset + 8 : slot.offset + 8 + len(data)] = _bytes(data, device)
        elif slot.nbytes:
            buffer[slot.offset : slot.offset + slot.nbytes] = as_bytes(value)
    return buffer, None


def as_bytes(value: torch.Tensor) -> torch.Tensor:
    """The bytes of `value`'s elements in row-major order, whatever its strides (a slice
    `y[..., ::2]`, a transpose, an `expand`), conjugate or negative bit: a flat uint8 tensor."""
    dense = value.detach().resolve_conj().resolve_neg().contiguous()
    return dense.reshape(-1).view(torch.uint8)


def error_message(
    lay: Layout, key: tuple, text: str, device: torch.device, timeout: bool = False
) -> torch.Tensor:
    """The message of `key` that carries `text` instead of values; the receiver raises
    `StageCommError(text)` (status 1), or `PipelineTimeoutError(text)` when the sender relays a
    timeout or a dead peer (status 2), so every rank of a broken pipeline raises the same class."""
    buffer = torch.empty(lay.size, dtype=torch.uint8, device=device)
    data = text.encode()[: lay.size - 8 * PREAMBLE]
    _preamble(buffer, key, status=2 if timeout else 1, length=len(data))
    buffer[8 * PREAMBLE : 8 * PREAMBLE + len(data)] = _bytes(data, device)
    return buffer


def unpack(buffer: torch.Tensor, lay: Layout, key: tuple) -> list[Any]:
    """The values of a received message; the sender's `StageCommError` if it sent one. A
    `torch.device` of the buffer's kind comes back as the buffer's (the receiver's) device."""
    magic, checksum, status, length = buffer[: 8 * PREAMBLE].view(torch.int64).tolist()
    if magic != MAGIC or checksum != key_checksum(key):
        raise StageCommError(
            f"a message for {key} starts with {[magic, checksum]}, not the expected "
            f"{[MAGIC, key_checksum(key)]}: the two ranks order their messages differently or "
            "run different versions of pdcompile"
        )
    if status:
        data = bytes(buffer[8 * PREAMBLE : 8 * PREAMBLE + length].cpu().tolist())
        text = data.decode(errors="replace")  # the sender may have cut a character in two
        if status == 2:
            raise PipelineTimeoutError(text)
        raise StageCommError(text)
    values = []
    for slot in lay.slots:
        part = buffer[slot.offset : slot.offset + slot.nbytes]
        if slot.dtype is None:
            size = int.from_bytes(bytes(part[:8].cpu().tolist()), "little")
            data = bytes(part[8 : 8 + size].cpu().tolist())
            values.append(decode_value(data, local=buffer.device))
        else:  # a view of the buffer: slots are 8-aligned, and the view keeps it alive
            values.append(part.view(slot.dtype).reshape(slot.shape))
    return values


def _mismatch(values: Sequence[Any], lay: Layout, src: int, dst: int) -> StageCommError | None:
    if len(values) != len(lay.slots):
        names = ", ".join(s.channel.name for s in lay.slots)
        return StageCommError(
            f"rank {src} sends {len(values)} values to rank {dst}, which expects "
            f"{len(lay.slots)} ({names})"
        )
    for slot, value in zip(lay.slots, values, strict=True):
        c = slot.channel
        where = f"channel {c.name!r} (stage {c.src_stage} -> {c.dst_stage})"
        if slot.dtype is None:
            if isinstance(value, torch.Tensor):
                return StageCommError(
                    f"{where}: rank {src} sent a tensor to rank {dst}, which expects a value "
                    f"({c.value_type})"
                )
            size = len(encode_value(value))
            if size > VALUE_SLOT - 8:
                return StageCommError(
                    f"{where}: a value of {size} bytes does not fit the {VALUE_SLOT - 8} a "
                    "message keeps for metadata; send it as a tensor"
                )
            continue
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        shape = list(value.shape) if isinstance(value, torch.Tensor) else None
        if got != slot.dtype or tuple(shape or ()) != slot.shape or shape is None:
            expected = f"{str(slot.dtype).removeprefix('torch.')}{list(slot.shape)}"
            sent = f"{str(got).removeprefix('torch.')}{shape if shape is not None else ''}"
            return StageCommError(
                f"{where}: rank {src} sent {sent} to rank {dst}, which expects "
                f"{c.describe()} = {expected} for this microbatch; the sender's stage computes "
                "another shape than the one captured (a different sequence length or dtype?)"
            )
        if value.layout != torch.strided:
            return StageCommError(
                f"{where}: rank {src} sent a {value.layout} tensor to rank {dst}; only dense "
                "tensors travel between stages: return value.to_dense() from the stage"
            )
    return None


def _preamble(buffer: torch.Tensor, key: tuple, status: int, length: int) -> None:
    ints = torch.tensor([MAGIC, key_checksum(key), status, length], dtype=torch.int64)
    buffer[: 8 * PREAMBLE] = ints.view(torch.uint8).to(buffer.device)


def _bytes(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def encode_value(value: Any) -> bytes:
    """UTF-8 JSON with type tags; `StageCommError` for types that do not travel."""
    return json.dumps(_tagged(value), separators=(",", ":")).encode()


def decode_value(data: bytes, local: torch.device | None = None) -> Any:
    """The value `encode_value` encoded, with its Python type (a tuple stays a tuple). With
    `local`, a device of its kind becomes `local`: the sender's `cuda:0` is the receiver's
    `cuda:1`, while a `cpu` sent by a GPU stage stays `cpu`."""
    return _untagged(json.loads(data.decode()), local)


def _tagged(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Size):  # before tuple: Size is a tuple
        return {"size": list(value)}
    if isinstance(value, tuple):
        return {"tuple": [_tagged(v) for v in value]}
    if isinstance(value, list):
        return [_tagged(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    raise StageCommError(
        f"cannot send a {type(value).__name__} between stages: values other than tensors must "
        f"be {_SUPPORTED} of them; return a tensor from the stage instead"
    )


def _untagged(data: Any, local: torch.device | None) -> Any:
    if isinstance(data, list):
        return [_untagged(v, local) for v in data]
    if not isinstance(data, dict):
        return data
    ((tag, body),) = data.items()
    if tag == "size":
        return torch.Size(body)
    if tag == "tuple":
        return tuple(_untagged(v, local) for v in body)
    if tag == "dtype" and isinstance(getattr(torch, body, None), torch.dtype):
        return getattr(torch, body)
    if tag == "device":
        device = torch.device(body)
        return local if local is not None and local.type == device.type else device
    raise StageCommError(f"unknown tag {tag!r} in a metadata value")
