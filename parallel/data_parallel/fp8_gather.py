"""--fp8-param-gather: the distributed optimizer's parameter all-gather of the FP8 layers'
weights in FP8 (one byte per element instead of the weights' two or four).

The FP8 weights sit in buffers of their own (parallel/data_parallel/ddp.py), whose pieces keep
fp32 masters apart from the weights even for fp32 weights. After the optimizer step has written
each rank's shard of the updated weights (the masters rounded to the weights' dtype), for each
buffer:

1. every weight's scales: under the per-tensor recipes one scale, from the amax of its part in
   this rank's shard all-reduced (MAX) over the buffer's data-parallel group and the weight's
   tensor-parallel group (the whole weight's); under blockwise one per 128 x 128 block of this
   TP rank's weight, from the block's amax all-reduced (MAX) over the data-parallel group (a
   shard's edge may cut a block). The weight's FP8 layer turns the amaxes into scales
   (`Fp8Weight.gather_scale`: tensorwise's fp8_max / amax, delayed scaling's scale, which
   records the amax for the next update, or blockwise's power of 2);
2. each rank quantises its shard to E4M3 bytes with those scales, the bytes are all-gathered
   bucket by bucket, and each weight is set to its bytes times the inverse scales.

With sharded parameters (optim_grads_params) the scales are made once after each step (and at
the start) and kept; each time a unit's weights are gathered for its forward or backward
(parallel/data_parallel/fsdp_params.py) its shards travel as E4M3 bytes with those scales,
while each rank's shard keeps its weights' own values.

The model then holds the FP8 values, so the layer's forward, quantising the weight again with
the same scale, gets the gathered bytes bit for bit (x * s rounds back to the byte it came
from: the weight's rounding to its dtype moves it far less than half an FP8 step). Under
blockwise the forward and the backward (W^T: the same 128 x 128 blocks, transposed) make each
block's scale again from the FP8 values: a power of 2 from their amax, the gathered scale or,
where the block's largest byte is 224, twice it, which gives the same values. MX's 1 x 32
blocks are not gathered so: the backward's blocks of W^T run along the other dimension, and
quantising the FP8 values again along it is not what the run without the flag computes. A run with
the flag computes what the run without it computes; only what travels, and what the weights
hold between steps, change. Under the distributed optimizer the gather is not overlapped with
the forward (the weights are set from their bytes as soon as they arrive); under sharded
parameters it is prefetched as the units' gathers are.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.distributed as dist

from parallel.comm import all_gather_into, all_reduce

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


class Fp8Weight(Protocol):
    """What a weight gathered in FP8 carries as `param.fp8_gather` (engine/ops/fp8/linear.py's
    Fp8Linear)."""

    tp_group: object
    weight_block: tuple[int, int] | None  # (rows, columns) of a scale's block; None: per tensor

    def gather_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The scales the weight is gathered and multiplied with, from the whole weight's amax
        (per tensor: [1, 1]; under delayed scaling that amax is recorded for the next update)
        or its blocks' ([rows, columns] of blocks)."""
        ...

    def weight_unchanged(self) -> None:
        """A step the optimizer skipped: the weight is not gathered again (under delayed
        scaling its last gather's amax is recorded for this step)."""
        ...


def is_fp8_gathered(param: torch.nn.Parameter) -> bool:
    return getattr(param, "fp8_gather", None) is not None


def to_fp8_bytes(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values x scale (one, or one per value) in E4M3 with saturation, as bytes
    (engine/ops/fp8/quantize.py's rounding)."""
    scaled = values.float() * (scale.reshape(()) if scale.numel() == 1 else scale)
    return torch.clamp(scaled, -E4M3_MAX, E4M3_MAX).to(E4M3).view(torch.uint8)


def _grid(param) -> tuple[int, int]:
    """The weight's blocks: (rows, columns) of them."""
    block = param.fp8_gather.weight_block
    if block is None:
        return (1, 1)
    rows, cols = param.shape
    return (-(-rows // block[0]), -(-cols // block[1]))


def block_of(param, first: int, last: int) -> torch.Tensor:
    """The index (in the weight's row-major grid of blocks) of the block of each of its
    flattened elements first..last-1."""
    block = param.fp8_gather.weight_block
    index = torch.arange(first, last, device=param.device)
    if block is None:
        return torch.zeros_like(index)
    cols = param.shape[1]
    return (index // cols // block[0]) * _grid(param)[1] + index % cols // block[1]


def _whole_amaxes(buffer) -> list[torch.Tensor]:
    """Each weight's amaxes, [rows, columns] of its blocks ([1, 1] per tensor), over the whole
    weight (step 1 of the module docstring)."""
    sizes = [math.prod(_grid(param)) for param in buffer.params]
    flat = torch.zeros(sum(sizes), device=buffer.params[0].device)
    parts = list(flat.split(sizes))
    for param, part in zip(buffer.params, parts, strict=True):
        where = buffer.in_own_shard(param)
        if where is None:
            continue
        values = buffer.data_of(*where).detach().abs().float()
        if param.fp8_gather.weight_block is None:
            part.copy_(values.amax())
        else:
            start = buffer.param_range[param][0]
            blocks = block_of(param, where[1] - start, where[2] - start)
            part.scatter_reduce_(0, blocks, values, "amax")
    all_reduce(flat, buffer.dp_group, op=dist.ReduceOp.MAX)
    groups: dict[int, list[int]] = {}  # per-tensor weights by TP group, in every rank's order
    for index, param in enumerate(buffer.params):
        if param.fp8_gather.weight_block is None:
            groups.setdefault(id(param.fp8_gather.tp_group), []).append(index)
    for indices in groups.values():
        whole = torch.cat([parts[i] for i in indices])
        all_reduce(whole, buffer.params[indices[0]].fp8_gather.tp_group, op=dist.ReduceOp.MAX)
        for i, amax in zip(indices, whole, strict=True):
            parts[i].copy_(amax)
    return [part.view(_grid(param)) for param, part in zip(buffer.params, parts, strict=True)]


def _scales_of(param, scales: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """The scale of each of the weight's flattened elements first..last-1 (one per tensor)."""
    if scales.numel() == 1:
        return scales
    return scales.reshape(-1)[block_of(param, first, last)]


def _dequantized(param, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The whole weight from its E4M3 bytes and its scales, in its dtype and shape."""
    values = data.view(E4M3).float()
    block = param.fp8_gather.weight_block
    if block is None:
        return (values * (1.0 / scales.reshape(()))).to(param.dtype).view_as(param)
    (rows, cols), (grid_rows, grid_cols) = param.shape, _grid(param)
    pad = (0, grid_cols * block[1] - cols, 0, grid_rows * block[0] - rows)
    blocks = torch.nn.functional.pad(values.view(rows, cols), pad)
    blocks = blocks.view(grid_rows, block[0], grid_cols, block[1])
    blocks = blocks * (1.0 / scales).view(grid_rows, 1, grid_cols, 1)
    return blocks.view(grid_rows * block[0], -1)[:rows, :cols].to(param.dtype)


def fp8_scales(buffer) -> dict:
    """Each weight of the buffer -> its gather's scales (step 1 of the module docstring)."""
    amaxes = _whole_amaxes(buffer)
    return {p: p.fp8_gather.gather_scale(a) for p, a in zip(buffer.params, amaxes, strict=True)}


def shard_bytes(buffer, bucket, scales: dict) -> torch.Tensor:
    """This rank's shard of the bucket's weights in E4M3 bytes (zeros in the padding)."""
    lo, hi = buffer.shard_range(bucket)
    out = torch.zeros(hi - lo, dtype=torch.uint8, device=buffer.params[0].device)
    for param in bucket.params:
        start, end = buffer.param_range[param]
        a, b = max(start, lo), min(end, hi)
        if a < b:
            scale = _scales_of(param, scales[param], a - start, b - start)
            out[a - lo : b - lo] = to_fp8_bytes(buffer.data_of(bucket, a, b), scale)
    return out


def gather_bytes(buffer, bucket, shard: torch.Tensor, async_op: bool = False):
    """(the bucket's bytes, the work handle with async_op): every rank's `shard` (shard_bytes)
    all-gathered over the buffer's data-parallel group."""
    lo, hi = buffer.shard_range(bucket)
    wire = torch.empty(bucket.numel, dtype=torch.uint8, device=shard.device)
    mine = wire[lo - bucket.start : hi - bucket.start]
    mine.copy_(shard)
    if buffer.dp_group is None:
        return wire, None
    return wire, all_gather_into(wire, mine, buffer.dp_group, async_op=async_op)


def set_from_bytes(buffer, bucket, wire: torch.Tensor, scales: dict) -> None:
    """Each weight of the bucket set to its gathered bytes times its inverse scales."""
    for param in bucket.params:
        start, end = buffer.param_range[param]
        data = wire[start - bucket.start : end - bucket.start]
        param.data.copy_(_dequantized(param, data, scales[param]))


def gather_fp8_weights(buffer) -> None:
    """Steps 1 and 2 of the module docstring for one ParamAndGradBuffer of FP8 weights whose
    shards the optimizer has just written (the distributed optimizer's gather)."""
    scales = fp8_scales(buffer)
    for bucket in reversed(buffer.buckets):
        wire, _ = gather_bytes(buffer, bucket, shard_bytes(buffer, bucket, scales))
        set_from_bytes(buffer, bucket, wire, scales)


def weights_unchanged(buffer) -> None:
    """After a step the optimizer skipped: the buffer's weights keep their FP8 values."""
    for param in buffer.params:
        param.fp8_gather.weight_unchanged()


def prepare_sharded_fp8(buffer) -> None:
    """Sharded parameters: after the optimizer's step, each weight's scales and each bucket's
    shard in E4M3 bytes (bucket.fp8_shard), which every gather of the step sends."""
    scales = fp8_scales(buffer)
    for bucket in buffer.buckets:
        bucket.fp8_shard = (shard_bytes(buffer, bucket, scales), scales)
