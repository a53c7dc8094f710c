"""Reading DCP's `.metadata` file without running anything it might contain.

torch.distributed.checkpoint writes its metadata with pickle, and a pickle can name any
callable. `load_metadata` unpickles with an exact allow-list of (module, name) pairs: DCP's own
metadata classes and the few torch values they hold (sizes, dtypes, the layout). Nothing is
allowed by prefix, and a dotted name (which pickle would resolve attribute by attribute, e.g.
`filesystem.os.system`) is refused outright. The result is then checked field by field, so
that what DCP reads next (file names, offsets, tensor shapes) is well formed: every entry must
be a tensor (this engine never stores pickled byte blobs, which DCP would load with full
pickle), and every storage file must be a plain file name inside the checkpoint folder.
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from parallel.errors import CheckpointError

TENSOR_DTYPES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)
_DCP = "torch.distributed.checkpoint"
ALLOWED_GLOBALS = frozenset(
    {
        (f"{_DCP}.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {(f"{_DCP}.filesystem", "_StorageInfo")}
    | {("torch", "Size"), ("torch.serialization", "_get_layout")}
    | {("torch", dtype) for dtype in TENSOR_DTYPES}
    # StorageMeta.checkpoint_id holds the path the checkpoint was saved to.
    | {("pathlib", "PosixPath"), ("pathlib._local", "PosixPath")}
)


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if "." in name or (module, name) not in ALLOWED_GLOBALS:
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


class _Refused(Exception):
    """A global outside the allow-list; carries its dotted name."""


def load_metadata(data: bytes, where: str) -> Metadata:
    """The Metadata pickled in `data` (the bytes of the file `where`), or CheckpointError.

    Nothing outside the allow-list is imported or called, whatever the bytes hold."""
    try:
        metadata = _AllowListUnpickler(io.BytesIO(data)).load()
    except _Refused as refused:
        raise CheckpointError(
            f"{where}: refers to {refused}, which no checkpoint holds; refusing to load it "
            "(nothing was run). Only load checkpoints from sources you trust"
        ) from None
    except Exception as err:  # noqa: BLE001 - any malformed pickle is a damaged file
        raise CheckpointError(
            f"{where}: not readable checkpoint metadata ({type(err).__name__}: {err}); the "
            "checkpoint is damaged or was not written by torch.distributed.checkpoint"
        ) from None
    problem = _metadata_problem(metadata)
    if problem:
        raise CheckpointError(f"{where}: malformed checkpoint metadata: {problem}")
    return metadata


def _is_size(value, ndim: int | None = None) -> bool:
    return (
        isinstance(value, torch.Size)
        and all(isinstance(n, int) and n >= 0 for n in value)
        and (ndim is None or len(value) == ndim)
    )


def _tensor_entry_problem(key, entry) -> str | None:
    if not isinstance(key, str):
        return f"a key of type {type(key).__name__}"
    if not isinstance(entry, TensorStorageMetadata):
        return f"{key!r} is a {type(entry).__name__}, not a tensor (only tensors are loaded)"
    properties = entry.properties
    if not isinstance(properties, TensorProperties) or properties.dtype not in {
        getattr(torch, name) for name in TENSOR_DTYPES
    }:
        return f"{key!r} has no valid dtype"
    if not _is_size(entry.size):
        return f"{key!r} has an invalid size"
    if not isinstance(entry.chunks, list):
        return f"{key!r} has no chunk list"
    for chunk in entry.chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            return f"{key!r} has a malformed chunk"
        ndim = len(entry.size)
        if not (_is_size(chunk.offsets, ndim) and _is_size(chunk.sizes, ndim)):
            return f"{key!r} has a chunk of the wrong rank"
        if any(o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, entry.size)):
            return f"{key!r} has a chunk outside its size"
    return None


def _storage_entry_problem(index, info, tensors: dict) -> str | None:
    if not isinstance(index, MetadataIndex) or index.fqn not in tensors:
        return "a storage entry for no known tensor"
    if not (index.offset is None or _is_size(index.offset, len(tensors[index.fqn].size))):
        return f"storage entry of {index.fqn!r} has an invalid offset"
    if not isinstance(info, _StorageInfo):
        return f"storage entry of {index.fqn!r} is a {type(info).__name__}"
    name = info.relative_path
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\\" in name
        or name.startswith(".")
        or "\x00" in name
    ):
        return f"storage entry of {index.fqn!r} names {name!r}, not a file of the checkpoint"
    if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
        return f"storage entry of {index.fqn!r} has an invalid offset or length"
    if getattr(info, "transform_descriptors", None):
        return f"storage entry of {index.fqn!r} asks for stream transforms, never written here"
    return None


def _metadata_problem(metadata) -> str | None:
    """What is malformed about an unpickled Metadata, or None."""
    if not isinstance(metadata, Metadata):
        return f"holds a {type(metadata).__name__}, not DCP Metadata"
    tensors = metadata.state_dict_metadata
    if not isinstance(tensors, dict):
        return "no tensor table"
    for key, entry in tensors.items():
        problem = _tensor_entry_problem(key, entry)
        if problem:
            return problem
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return "no storage table"
    for index, info in storage.items():
        problem = _storage_entry_problem(index, info, tensors)
        if problem:
            return problem
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        return "a malformed storage description"
    if metadata.planner_data is not None and not isinstance(metadata.planner_data, dict):
        return "malformed planner data"
    return None
