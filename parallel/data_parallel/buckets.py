"""Gradient buckets: how DistributedDataParallel (parallel/data_parallel/ddp.py) cuts a model
chunk's flattened parameters into contiguous slices, and how their memory is released and given
back.

Buckets follow the reverse parameter order (roughly the order backward produces gradients),
each cut once it holds `bucket_size` elements, or with sharded parameters one per sharding
unit (a layer, the embeddings, ...). A bucket ends on a multiple of `alignment` elements
(16 x DP when it is sharded), so each rank's shard has the same size. Memory is released by
shrinking a tensor's storage to zero bytes and given back in place, so views of it
(parameters, main grads, tensors autograd saved) stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

SHARD_ALIGNMENT = 16


def release(tensor: torch.Tensor) -> None:
    """Free the memory of a tensor that owns its storage; its views stay valid objects."""
    tensor.untyped_storage().resize_(0)


def allocate(tensor: torch.Tensor) -> None:
    """Give a released tensor its memory back (uninitialized)."""
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


def is_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() > 0


@dataclass(eq=False)
class Bucket:
    """A contiguous slice [start, end) of the flattened parameters and the parameters inside."""

    index: int
    params: list[nn.Parameter]
    start: int
    end: int  # includes the padding
    grad: torch.Tensor  # full gradient: a view of grad_buffer, or its own (released) storage
    data: torch.Tensor  # full parameters: a view of param_buffer, or its own storage
    grad_shard: torch.Tensor | None = None  # sharded gradients: this rank's reduced shard
    data_shard: torch.Tensor | None = None  # sharded parameters: this rank's shard
    unit: nn.Module | None = None  # sharded parameters: the module whose forward uses them
    pending: set = field(default_factory=set)
    passed: set = field(default_factory=set)  # split backward: parameters it is done with
    delayed: bool = False  # holds a pipeline-shared weight: reduce in finish_grad_sync only
    grad_work: object = None
    grad_shard_tmp: torch.Tensor | None = None
    param_work: object = None
    gathered: bool = False  # sharded parameters: data holds the full parameters now
    # sharded FP8 weights: (this rank's shard in E4M3 bytes, the weights' scales) made after
    # the step, and (the bucket's bytes being gathered, their scales)
    fp8_shard: tuple[torch.Tensor, dict] | None = None
    fp8_wire: tuple[torch.Tensor, dict] | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start


Layout = tuple[list[Bucket], dict[nn.Parameter, tuple[int, int]], int]


def _close(buckets: list, params, start: int, offset: int, alignment: int, unit=None) -> int:
    """Add the bucket [start, offset rounded up to alignment) holding params; its end."""
    end = -(-offset // alignment) * alignment
    bucket = Bucket(len(buckets), params, start, end, None, None, unit=unit)
    bucket.delayed = any(getattr(p, "pipeline_shared", False) for p in params)
    bucket.pending = set(params)
    buckets.append(bucket)
    return end


def layout_buckets(params: list[nn.Parameter], bucket_size: int, alignment: int) -> Layout:
    """(buckets, param -> [start, end) in the flattened parameters, total elements): reverse
    parameter order, a bucket cut once it holds bucket_size elements."""
    buckets, ranges = [], {}
    offset, current, start = 0, [], 0
    for param in reversed(params):
        ranges[param] = (offset, offset + param.numel())
        offset += param.numel()
        current.append(param)
        if offset - start >= bucket_size:
            offset = start = _close(buckets, current, start, offset, alignment)
            current = []
    if current:
        offset = _close(buckets, current, start, offset, alignment)
    return buckets, ranges, offset


def layout_unit_buckets(
    module: nn.Module, params: list[nn.Parameter], units: list[nn.Module], alignment: int
) -> Layout:
    """As layout_buckets, one bucket per sharding unit, in reverse forward order; a parameter
    belongs to the innermost unit holding it, and those of no unit make a first unit, the
    whole module (gathered for its whole forward)."""
    trainable = set(params)
    owner, seen = {}, set()
    for unit in sorted(units, key=lambda u: sum(1 for _ in u.parameters())):
        owner[unit] = [p for p in unit.parameters() if p in trainable and p not in seen]
        seen.update(owner[unit])
    groups = [(unit, owner[unit]) for unit in units if owner[unit]]
    rest = [p for p in params if p not in seen]
    if rest:
        groups.insert(0, (module, rest))
    buckets, ranges, offset = [], {}, 0
    for unit, members in reversed(groups):
        start = offset
        for param in reversed(members):
            ranges[param] = (offset, offset + param.numel())
            offset += param.numel()
        offset = _close(buckets, list(reversed(members)), start, offset, alignment, unit)
    return buckets, ranges, offset
