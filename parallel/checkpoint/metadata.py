"""Reading DCP's `.metadata` file without running anything it might contain.

torch.distributed.checkpoint writes its metadata with pickle, and a pickle can name any
callable. `load_metadata` unpickles with an exact allow-list of (module, name) pairs: DCP's own
metadata classes and the few torch values they hold (sizes, dtypes, the layout). Nothing is
allowed by prefix, and a dotted name (which pickle would resolve attribute by attribute, e.g.
`filesystem.os.system`) is refused outright. The result is then checked field by field, so
that what DCP reads next (file names, offsets, tensor shapes) is well formed: every entry must
be a tensor (this engine never stores pickled byte blobs, which DCP would load with full
pickle), and every storage file must be a plain file name inside the checkpoint folder. The
opcodes are walked once before unpickling, so that a damaged length cannot make the unpickler
allocate gigabytes.
"""

from __future__ import annotations

import io
import pickle
import pickletools

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
# Megatron-LM's torch_dist checkpoints also hold byte entries (TransformerEngine's
# `_extra_state`, pickled objects: dropped unread) and megatron-core's cached save plans in the
# planner data (DCP's own plan classes: plain records, never used here).
FOREIGN_GLOBALS = ALLOWED_GLOBALS | {
    (f"{_DCP}.metadata", "BytesStorageMetadata"),
    *(
        (f"{_DCP}.planner", n)
        for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    ),
}


_DTYPE_OBJECTS = frozenset(getattr(torch, name) for name in TENSOR_DTYPES)


class _AllowListUnpickler(pickle.Unpickler):
    allowed = ALLOWED_GLOBALS

    def find_class(self, module: str, name: str):
        if "." in name or (module, name) not in self.allowed:
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


class _ForeignUnpickler(_AllowListUnpickler):
    allowed = FOREIGN_GLOBALS


class _Refused(Exception):
    """A global outside the allow-list; carries its dotted name."""


def load_metadata(data: bytes, where: str, foreign: bool = False) -> Metadata:
    """The Metadata pickled in `data` (the bytes of the file `where`), or CheckpointError.

    Nothing outside the allow-list is imported or called, whatever the bytes hold. `foreign`:
    a Megatron-LM checkpoint, whose byte entries are dropped (with their storage entries)
    before the checks, so that nothing can ever unpickle them."""
    try:
        _check_opcodes(data)
        unpickler = _ForeignUnpickler if foreign else _AllowListUnpickler
        metadata = unpickler(io.BytesIO(data)).load()
        if foreign:
            _drop_byte_entries(metadata)
    except _Refused as refused:
        raise CheckpointError(
            f"{where}: refers to {refused}, which no checkpoint holds; refusing to load it "
            "(nothing was run). Only load checkpoints from sources you trust"
        ) from None
    except Exception as err:  # noqa: BLE001 - any malformed pickle is a damaged file
        raise CheckpointError(
            f"{where}: not readable checkpoint metadata ({_brief(err)}); the "
            "checkpoint is damaged or was not written by torch.distributed.checkpoint"
        ) from None
    try:
        problem = _metadata_problem(metadata)
    except (AttributeError, TypeError, ValueError, RecursionError) as err:
        problem = _brief(err)  # a shape the checks above did not foresee
    if problem:
        raise CheckpointError(f"{where}: malformed checkpoint metadata: {problem}")
    return metadata


def _drop_byte_entries(metadata) -> None:
    tensors = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(tensors, dict) or not isinstance(storage, dict):
        return  # reported by the checks
    dropped = {k for k, v in tensors.items() if not isinstance(v, TensorStorageMetadata)}
    dropped = {k for k in dropped if type(tensors[k]).__name__ == "BytesStorageMetadata"}
    for key in dropped:
        del tensors[key]
    # Where each dropped entry's bytes are (file, offset, length), for a caller that reads one
    # itself with a restricted loader (Megatron-LM's common state); DCP never sees them.
    metadata.dropped_objects = {}
    for index in [i for i in storage if getattr(i, "fqn", None) in dropped]:
        metadata.dropped_objects[index.fqn] = storage.pop(index)
    metadata.planner_data = None


_MEMO_OPCODES = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})


def _check_opcodes(data: bytes) -> None:
    """Walk the opcodes before unpickling: a memo index larger than the pickle could have
    assigned (a flipped length byte, say) would make the unpickler allocate gigabytes."""
    for count, (opcode, argument, _) in enumerate(pickletools.genops(data)):
        if opcode.name in _MEMO_OPCODES and int(argument) > count:
            raise ValueError(f"memo index {argument} at opcode {count}")
        if opcode.name == "FRAME" and argument > len(data):
            raise ValueError(f"frame of {argument} bytes in {len(data)}")


def _brief(err: BaseException) -> str:
    """An exception as one short line (a damaged pickle's message can hold anything)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"


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
    # Fields are read with getattr: a pickle can build an object without running __init__.
    properties = getattr(entry, "properties", None)
    dtype = getattr(properties, "dtype", None)
    if not isinstance(properties, TensorProperties) or not isinstance(dtype, torch.dtype):
        return f"{key!r} has no valid dtype"
    if dtype not in _DTYPE_OBJECTS:
        return f"{key!r} has no valid dtype"
    size = getattr(entry, "size", None)
    if not _is_size(size):
        return f"{key!r} has an invalid size"
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list):
        return f"{key!r} has no chunk list"
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not isinstance(chunk, ChunkStorageMetadata):
            return f"{key!r} has a malformed chunk"
        if not (_is_size(offsets, len(size)) and _is_size(sizes, len(size))):
            return f"{key!r} has a chunk of the wrong rank"
        if any(o + n > s for o, n, s in zip(offsets, sizes, size, strict=False)):
            return f"{key!r} has a chunk outside its size"
    return None


def _storage_entry_problem(index, info, tensors: dict) -> str | None:
    fqn = getattr(index, "fqn", None)
    if not isinstance(index, MetadataIndex) or not isinstance(fqn, str) or fqn not in tensors:
        return "a storage entry for no known tensor"
    offset = getattr(index, "offset", None)
    if not (offset is None or _is_size(offset, len(tensors[fqn].size))):
        return f"storage entry of {fqn!r} has an invalid offset"
    if not isinstance(info, _StorageInfo):
        return f"storage entry of {fqn!r} is a {type(info).__name__}"
    name = getattr(info, "relative_path", None)
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\\" in name
        or name.startswith(".")
        or "\x00" in name
    ):
        return f"storage entry of {fqn!r} names {name!r}, not a file of the checkpoint"
    place = (getattr(info, "offset", None), getattr(info, "length", None))
    if not all(isinstance(n, int) and n >= 0 for n in place):
        return f"storage entry of {fqn!r} has an invalid offset or length"
    if getattr(info, "transform_descriptors", None):
        return f"storage entry of {fqn!r} asks for stream transforms, never written here"
    return None


def _metadata_problem(metadata) -> str | None:
    """What is malformed about an unpickled Metadata, or None."""
    if not isinstance(metadata, Metadata):
        return f"holds a {type(metadata).__name__}, not DCP Metadata"
    tensors = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(tensors, dict):
        return "no tensor table"
    for key, entry in tensors.items():
        problem = _tensor_entry_problem(key, entry)
        if problem:
            return problem
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return "no storage table"
    for index, info in storage.items():
        problem = _storage_entry_problem(index, info, tensors)
        if problem:
            return problem
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        return "a malformed storage description"
    planner_data = getattr(metadata, "planner_data", None)
    if planner_data is not None and not isinstance(planner_data, dict):
        return "malformed planner data"
    return None
