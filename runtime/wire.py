"""The wire format of stage messages: dtype codes, message headers and metadata without pickle.

A message is a list of values. Its header is a flat list of int64, one entry per value:
`[dtype code, ndim, *dims]` for a tensor and `[VALUE, num_bytes]` for metadata, which travels as
the UTF-8 bytes of a JSON document with type tags (`{"size": [2, 3]}` is `torch.Size([2, 3])`),
so a receiver never unpickles what a peer sent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdcompile.errors import StageCommError
from pdcompile.runtime.comm import check_value
from pdcompile.staged_program import Channel

VALUE = -1  # the code of a metadata value in a header

# The position of a dtype is its code: append new dtypes, never reorder (both ends must agree).
_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
DTYPES = tuple(getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name))
_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
_SUPPORTED = "None, bool, int, float, str, torch.Size, torch.dtype, torch.device, tuples and lists"


@dataclass(frozen=True)
class Item:
    """One value of a message as its header describes it: `dtype` is None for metadata."""

    dtype: torch.dtype | None
    shape: tuple[int, ...]

    def empty(self, device: torch.device) -> torch.Tensor:
        """A receive buffer: the tensor itself, or the bytes of the metadata's encoding."""
        return torch.empty(self.shape, dtype=self.dtype or torch.uint8, device=device)

    def describe(self) -> str:
        if self.dtype is None:
            return f"a value of {self.shape[0]} bytes"
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


def pack(values: Sequence[Any], device: torch.device) -> tuple[list[int], list[torch.Tensor]]:
    """The header and the payload (one contiguous tensor on `device` per value) of a message."""
    header: list[int] = []
    payload: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.dtype not in _CODES:
                raise StageCommError(
                    f"cannot send a {value.dtype} tensor between stages: the wire format knows "
                    f"{', '.join(_DTYPE_NAMES)}; cast it in the model or add the dtype to "
                    "runtime/wire.py"
                )
            header += [_CODES[value.dtype], value.dim(), *value.shape]
            payload.append(value.detach().to(device).contiguous())
        else:
            data = encode_value(value)
            header += [VALUE, len(data)]
            payload.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device))
    return header, payload


def parse_header(header: Sequence[int], num_values: int) -> list[Item]:
    """The items a header describes; `StageCommError` if it is not a header of `num_values`."""
    items, i = [], 0
    while i < len(header):
        code, count = header[i], header[i + 1] if i + 1 < len(header) else -1
        dims = tuple(header[i + 2 : i + 2 + count])
        if code == VALUE:
            items.append(Item(None, (count,)))
            i += 2
        elif 0 <= code < len(DTYPES) and len(dims) == count >= 0:
            items.append(Item(DTYPES[code], dims))
            i += 2 + count
        else:
            break
    if i != len(header) or len(items) != num_values:
        raise StageCommError(
            f"malformed message header {list(header)} (expected {num_values} values): the ranks "
            "run different versions of pdcompile, or their messages are out of order"
        )
    return items


def check_header(
    items: Sequence[Item], channels: Sequence[Channel], src: int, dst: int, what: str
) -> StageCommError | None:
    """The error a header already shows, if any, under `check_value`'s rules (metadata values
    are checked once they have arrived)."""
    if len(items) != len(channels):
        return StageCommError(
            f"{what}: rank {src} sent {len(items)} values to rank {dst}, which expects "
            f"{len(channels)} ({', '.join(c.name for c in channels)})"
        )
    for item, channel in zip(items, channels, strict=True):
        if item.dtype is None and channel.kind == "tensor":
            return StageCommError(
                f"channel {channel.name!r} (stage {channel.src_stage} -> {channel.dst_stage}): "
                f"rank {src} sent {item.describe()} to rank {dst}, which expects a tensor "
                f"{channel.describe()}"
            )
        if item.dtype is not None:
            try:
                check_value(
                    torch.empty(item.shape, dtype=item.dtype, device="meta"), channel, src, dst
                )
            except StageCommError as exc:
                return exc
    return None


def unpack(item: Item, buffer: torch.Tensor) -> Any:
    """The value a received buffer holds."""
    if item.dtype is not None:
        return buffer
    return decode_value(buffer.cpu().numpy().tobytes())


def encode_value(value: Any) -> bytes:
    """UTF-8 JSON with type tags; `StageCommError` for types that do not travel."""
    return json.dumps(_tagged(value), separators=(",", ":")).encode()


def decode_value(data: bytes) -> Any:
    """The value `encode_value` encoded, with its Python type (a tuple stays a tuple)."""
    return _untagged(json.loads(data.decode()))


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


def _untagged(data: Any) -> Any:
    if isinstance(data, list):
        return [_untagged(v) for v in data]
    if not isinstance(data, dict):
        return data
    ((tag, body),) = data.items()
    if tag == "size":
        return torch.Size(body)
    if tag == "tuple":
        return tuple(_untagged(v) for v in body)
    if tag == "dtype" and isinstance(getattr(torch, body, None), torch.dtype):
        return getattr(torch, body)
    if tag == "device":
        return torch.device(body)
    raise StageCommError(f"unknown tag {tag!r} in a metadata value")
