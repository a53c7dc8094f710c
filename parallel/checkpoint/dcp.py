"""torch.distributed.checkpoint (DCP) glue for tensors split into arbitrary boxes.

DCP saves and loads tensors whose ranks each hold some rectangular chunks ("boxes") of a
global tensor, and reshards on load: any layout reads any other. DTensor and ShardedTensor
describe regular splits; a distributed-optimizer shard cuts a parameter at arbitrary flat
offsets, so `BoxTensor` implements DCP's checkpointable protocol for a list of boxes directly
(see parallel.tensor_parallel.sharding.checkpoint_boxes). `BoxSavePlanner` / `BoxLoadPlanner` teach
the default planners to look boxes up.

Loading unpickles nothing arbitrary: every value is a tensor (no byte blobs: the metadata
reader refuses them, and the load planner too), tensor data is read by
torch.load(weights_only=True) inside DCP, and DCP's own `.metadata` file is read through an
exact allow-list (`SafeFileSystemReader`, see parallel/checkpoint/metadata.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from parallel.checkpoint.metadata import load_metadata
from parallel.errors import CheckpointError


@dataclass
class BoxTensor:
    """The boxes of one global tensor that this rank holds (possibly none).

    boxes: list of (global offset, tensor of the box's size). On save the tensors are read;
    on load they are written in place (views of live state work). Two boxes may cover the
    same region (one rank holding both copies of a tied embedding, as zb-v's first rank
    does): DCP names each local chunk by its position in the list, and each box is filled."""

    global_shape: torch.Size
    dtype: torch.dtype
    boxes: list[tuple[tuple[int, ...], torch.Tensor]]

    def size(self) -> torch.Size:  # DCP compares it with the stored size on load
        return self.global_shape

    def tensor_at(self, offsets, position: int | None = None) -> torch.Tensor:
        """The box at global `offsets`; `position` (DCP's index of the local chunk) picks
        among boxes that start at the same place."""
        if position is not None and 0 <= position < len(self.boxes):
            offset, tensor = self.boxes[position]
            if tuple(offset) == tuple(offsets):
                return tensor
        for offset, tensor in self.boxes:
            if tuple(offset) == tuple(offsets):
                return tensor
        raise KeyError(f"no box at {tuple(offsets)}")

    # DCP's checkpointable protocol ------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        items = []
        for offset, tensor in self.boxes:
            offsets = torch.Size(offset)
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=tensor.size()),
                        properties=TensorProperties.create_from_tensor(tensor),
                        size=self.global_shape,
                    ),
                )
            )
        return items

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), t.size()) for o, t in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.tensor_at(index.offset)


@dataclass
class LazyTensor:
    """A whole global tensor that is only produced when DCP writes it, so a checkpoint can be
    written tensor by tensor from another format without holding the model in memory."""

    global_shape: torch.Size
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]

    def size(self) -> torch.Size:
        return self.global_shape

    def tensor_at(self, offsets) -> torch.Tensor:
        tensor = self.load()
        if tensor.shape != self.global_shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"loaded {tuple(tensor.shape)} {tensor.dtype}, expected "
                f"{tuple(self.global_shape)} {self.dtype}"
            )
        return tensor

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        offsets = torch.Size([0] * len(self.global_shape))
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=self.global_shape),
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.global_shape,
                ),
            )
        ]


@dataclass
class LazyLayers:
    """A global tensor whose first dimension is the layer (megatron-core stacks every layer's
    tensor so), written one layer at a time: load(i) gives layer i without the leading 1."""

    global_shape: torch.Size
    dtype: torch.dtype
    load: Callable[[int], torch.Tensor]

    def size(self) -> torch.Size:
        return self.global_shape

    def tensor_at(self, offsets) -> torch.Tensor:
        tensor = self.load(int(offsets[0]))
        if tuple(tensor.shape) != tuple(self.global_shape[1:]) or tensor.dtype != self.dtype:
            raise ValueError(
                f"layer {int(offsets[0])}: loaded {tuple(tensor.shape)} {tensor.dtype}, "
                f"expected {tuple(self.global_shape[1:])} {self.dtype}"
            )
        return tensor.unsqueeze(0)

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        sizes = torch.Size([1, *self.global_shape[1:]])
        items = []
        for layer in range(self.global_shape[0]):
            offsets = torch.Size([layer] + [0] * (len(self.global_shape) - 1))
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                        properties=TensorProperties(dtype=self.dtype),
                        size=self.global_shape,
                    ),
                )
            )
        return items


class BoxSavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        if isinstance(value, BoxTensor | LazyTensor | LazyLayers):
            return value.tensor_at(index.offset)
        return super().lookup_object(index)


class BoxLoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up rebuilds every value it does not know as None; keep the boxes
        # out of it and put them back (the state dict is flat, so keys need no mapping).
        boxes = {k: v for k, v in state_dict.items() if isinstance(v, BoxTensor)}
        rest = {k: v for k, v in state_dict.items() if not isinstance(v, BoxTensor)}
        super().set_up_planner(rest, metadata, is_coordinator)
        self.state_dict.update(boxes)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        if isinstance(value, BoxTensor):
            return value.tensor_at(index.offset, index.index)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        # DCP would unpickle a byte entry with full pickle; this engine never writes one. (The
        # metadata reader already refuses such entries; this is the second guard.)
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn} is a pickled object, not a tensor; "
            "refusing to load it"
        )


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read by `parallel.checkpoint.metadata.load_metadata` (an
    exact allow-list, then field-by-field checks), with one-line errors naming the file.

    The metadata is parsed once per reader and kept: read it first (`read_metadata()`) to get
    its error as is, then hand the same reader to dcp.load, which would otherwise catch the
    error, retry other file names and report something else; reuse the reader for several
    loads from one checkpoint (the export reads tensor by tensor). Set `foreign` to read a
    Megatron-LM checkpoint (see load_metadata)."""

    foreign = False

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        if hasattr(self, "_get_metadata_path"):
            path = self._get_metadata_path(rank)
        else:  # torch versions without per-rank metadata files
            path = self.fs.concat_path(self.path, ".metadata")
        cache = self.__dict__.setdefault("_parsed", {})
        if str(path) not in cache:
            cache[str(path)] = self._parse(path)
        metadata = cache[str(path)]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata

    def _parse(self, path):
        try:
            with self.fs.create_stream(path, "rb") as stream:
                data = stream.read()
        except OSError as err:
            raise CheckpointError(
                f"{path}: cannot read the checkpoint's metadata ({err.strerror or err}); the "
                "checkpoint is incomplete or damaged"
            ) from None
        return load_metadata(data, str(path), foreign=getattr(self, "foreign", False))
