"""--fp8-param-gather: the distributed optimizer's parameter all-gather of the FP8 layers'
weights in FP8 (one byte per element instead of the weights' two or four).

The FP8 weights sit in buffers of their own (parallel/data_parallel/ddp.py), whose pieces keep
fp32 masters apart from the weights even for fp32 weights. After the optimizer step has written
each rank's shard of the updated weights (the masters rounded to the weights' dtype), for each
buffer:

1. every weight's scale: the amax of its part in this rank's shard, all-reduced (MAX) over the
   buffer's data-parallel group and the weight's tensor-parallel group, is the whole weight's;
   the weight's FP8 layer turns it into the scale (`Fp8Weight.gather_scale`: tensorwise's
   fp8_max / amax, or delayed scaling's scale, which records the amax for the next update);
2. each rank quantises its shard to E4M3 bytes with those scales, the bytes are all-gathered
   bucket by bucket, and each weight is set to its bytes times the inverse scale.

The model then holds the FP8 values, so the layer's forward, quantising the weight again with
the same scale, gets the gathered bytes bit for bit (x * s rounds back to the byte it came
from: the weight's rounding to its dtype moves it far less than half an FP8 step). A run with
the flag computes what the run without it computes; only what travels, and what the weights
hold between steps, change. The gather is not overlapped with the forward (the weights are
set from their bytes as soon as they arrive).
"""

from __future__ import annotations

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

    def gather_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The scale the weight is gathered and multiplied with, from the whole weight's amax
        (and, under delayed scaling, that amax recorded for the next update)."""
        ...


def is_fp8_gathered(param: torch.nn.Parameter) -> bool:
    return getattr(param, "fp8_gather", None) is not None


def to_fp8_bytes(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values x scale in E4M3 with saturation, as bytes (engine/ops/fp8/quantize.py's rounding)."""
    scaled = values.float() * scale.reshape(())
    return torch.clamp(scaled, -E4M3_MAX, E4M3_MAX).to(E4M3).view(torch.uint8)


def from_fp8_bytes(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.view(E4M3).float() * (1.0 / scale.reshape(()))).to(dtype)


def _whole_amaxes(buffer) -> torch.Tensor:
    """Each weight's amax over the whole weight (step 1 of the module docstring)."""
    amax = torch.zeros(len(buffer.params), device=buffer.param_buffer.device)
    for index, param in enumerate(buffer.params):
        where = buffer.in_own_shard(param)
        if where is not None:
            amax[index] = buffer.data_of(*where).detach().abs().amax().float()
    all_reduce(amax, buffer.dp_group, op=dist.ReduceOp.MAX)
    groups: dict[int, list[int]] = {}  # by TP group, in the buffer's order (every rank's)
    for index, param in enumerate(buffer.params):
        groups.setdefault(id(param.fp8_gather.tp_group), []).append(index)
    for indices in groups.values():
        part = amax[indices]
        all_reduce(part, buffer.params[indices[0]].fp8_gather.tp_group, op=dist.ReduceOp.MAX)
        amax[indices] = part
    return amax


def gather_fp8_weights(buffer) -> None:
    """Steps 1 and 2 of the module docstring for one ParamAndGradBuffer of FP8 weights whose
    shards the optimizer has just written."""
    amaxes = _whole_amaxes(buffer)
    scales = {p: p.fp8_gather.gather_scale(a) for p, a in zip(buffer.params, amaxes, strict=True)}
    for bucket in reversed(buffer.buckets):
        lo, hi = buffer.shard_range(bucket)
        wire = torch.zeros(bucket.numel, dtype=torch.uint8, device=bucket.data.device)
        for param in bucket.params:
            start, end = buffer.param_range[param]
            a, b = max(start, lo), min(end, hi)
            if a < b:
                values = buffer.param_buffer[a:b]
                wire[a - bucket.start : b - bucket.start] = to_fp8_bytes(values, scales[param])
        if buffer.dp_size > 1:
            mine = wire[lo - bucket.start : hi - bucket.start]
            all_gather_into(wire, mine, buffer.dp_group)
        for param in bucket.params:
            start, end = buffer.param_range[param]
            data = wire[start - bucket.start : end - bucket.start]
            param.data.copy_(from_fp8_bytes(data, scales[param], param.dtype).view_as(param))
