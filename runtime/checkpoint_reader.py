"""DCP's reader of a checkpoint folder with its `.metadata` unpickled safely: no code runs.

DCP writes `.metadata` (its index of shapes, dtypes and file offsets) with `pickle`, and its
`FileSystemReader` reads it back with `pickle.load`, which calls whatever the file names. The
checksums of `manifest.json` are no signature: whoever can write the folder can fix them up. So
`Reader.read_metadata` unpickles with an allow-list: the dataclasses of DCP's metadata, torch
dtypes, `torch.Size`, the layout lookup and `pathlib` paths, and nothing else (the approach of
Python's "Restricting Globals" and of torch's `weights_only` loader, whose unpickler lacks the
protocol-4 framing DCP writes). Any other global is refused with `CheckpointError` before it is
looked up. The tensors themselves DCP reads with `torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from pdcompile.core.errors import CheckpointError
from pdcompile.runtime.manifest import read_regular

__all__ = ["METADATA", "Reader", "read_metadata"]

METADATA = ".metadata"
_LIMIT = 1 << 30  # bytes: DCP's index of a model of 10^6 tensors is some hundreds of MiB
_CLASSES = {
    (c.__module__, c.__qualname__): c
    for c in (
        Metadata, StorageMeta, _StorageInfo, dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata, dcp_metadata.TensorProperties,
        dcp_metadata.ChunkStorageMetadata, dcp_metadata.MetadataIndex,
        dcp_metadata._MEM_FORMAT_ENCODING, pathlib.PurePosixPath, pathlib.PosixPath,
    )
}  # fmt: skip
_CLASSES[("torch", "Size")] = torch.Size
_CLASSES[("torch.serialization", "_get_layout")] = torch.serialization._get_layout


class _Unpickler(pickle.Unpickler):
    """An unpickler that finds only the allow-listed globals and torch's dtypes."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            return _CLASSES[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.where} names {module}.{name}, which DCP's metadata never holds: not loaded, "
            "nothing of it ran; the file was crafted or altered (a matching manifest.json is no "
            "signature): load a checkpoint your own jobs wrote"
        )


def read_metadata(path: str) -> Metadata:
    """The DCP metadata of the checkpoint folder `path`, unpickled without running code.

    Raises:
        OSError: no `.metadata` file, or it cannot be read.
        CheckpointError: it is not a regular file, names a global outside the allow-list
            (naming it: the file was crafted), or is not DCP metadata.
    """
    where = f"checkpoint {path}: {METADATA}"
    data = read_regular(os.path.join(path, METADATA), _LIMIT)
    try:
        metadata = _Unpickler(data, where).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated or malformed pickle: any error of the unpickler
        raise CheckpointError(
            f"{where} cannot be read ({type(exc).__name__}: {exc}): the file was altered; load "
            "an earlier checkpoint"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(
            f"{where} holds a {type(metadata).__name__}, not DCP metadata: the file was "
            "altered; load an earlier checkpoint"
        )
    return metadata


class Reader(FileSystemReader):
    """DCP's `FileSystemReader` whose `read_metadata` is `read_metadata` above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(
                f"checkpoint {self.path}: a per-rank DCP metadata file was asked for; pdcompile "
                "checkpoints have one .metadata"
            )
        metadata = read_metadata(os.fspath(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
