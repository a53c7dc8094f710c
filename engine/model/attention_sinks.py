"""Attention sinks: a logit per head beside every row's scores in the softmax, which takes
probability away from the keys without a value of its own (--softmax-type: megatron-core's
softmax_offset, gpt-oss's `sinks`). `off-by-one` fixes it at 0 (the denominator gains 1),
`learnable` learns it, split over TP with the heads.

    out = sum_j exp(s_j - T) v_j,   T = log(exp(sink) + sum_j exp(s_j))

is attention without the sink rescaled by exp(lse - T), lse its own log-sum-exp. So it runs
through the fused block kernels that return the log-sum-exp (parallel/context_parallel/
blocks.py: flash on the CPU, memory-efficient on CUDA), or with a sliding window through the
tiled fp32 path of ring attention (no [s, s] score tensor either way). Backward hands the
kernels the final output and T: the probabilities they recompute are then the sink-softmax's,
and the sink's gradient is -sum over rows of p_sink x (dout . out).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from parallel.comm import group_rank
from parallel.context_parallel.blocks import block_kernels
from parallel.context_parallel.ring import (
    Quarter,
    quarter_backward,
    quarter_forward,
    repeat_groups,
    sum_groups,
)
from parallel.tensor_parallel.init import draw_local
from parallel.tensor_parallel.sharding import set_tp_sharding, split_sharding


class AttentionSinks(nn.Module):
    """The sink logits of a layer's heads on this TP rank: megatron-core's
    core_attention.softmax_offset (a parameter for `learnable`, zeros for `off-by-one`)."""

    def __init__(self, ctx, name: str, heads: int, softmax_type: str):
        super().__init__()
        local = heads // ctx.tp_size
        if softmax_type == "learnable":
            sharding = split_sharding(0, [heads], group_rank(ctx.tp_group), ctx.tp_size)
            drawn = draw_local(
                (heads, 1), sharding, ctx.init_method, ctx.param_seed(name), ctx.device
            )
            weight = drawn.view(local).to(ctx.device, ctx.params_dtype)
            self.softmax_offset = nn.Parameter(weight)
            set_tp_sharding(self.softmax_offset, sharding)
        else:
            zeros = torch.zeros(local, device=ctx.device, dtype=ctx.params_dtype)
            self.register_buffer("softmax_offset", zeros, persistent=False)

    def forward(self) -> torch.Tensor:
        return self.softmax_offset


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, window):
        heads, scale, acc = q.shape[1], 1.0 / math.sqrt(q.shape[-1]), _accumulation(q.dtype)
        keys, values = repeat_groups(k, heads), repeat_groups(v, heads)
        if window is None:
            out, lse = block_kernels(q.device).forward(q, keys, values, True, scale)
        else:
            whole = Quarter(slice(0, q.shape[2]), slice(0, q.shape[2]), 0, 0, False)
            out, lse = quarter_forward(
                q.to(acc), keys.to(acc), values.to(acc), whole, window, scale
            )
        out, lse = out.to(acc), lse.to(acc)
        total = torch.logaddexp(lse, sink.to(acc)[None, :, None])
        final = (out * torch.exp(lse - total)[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, sink, final, total)
        ctx.window, ctx.scale = window, scale
        return final

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sink, final, total = ctx.saved_tensors
        window, scale, acc = ctx.window, ctx.scale, _accumulation(q.dtype)
        heads, groups = q.shape[1], k.shape[1]
        keys, values = repeat_groups(k, heads), repeat_groups(v, heads)
        delta = (dout.to(acc) * final.to(acc)).sum(-1)
        if window is None:
            kernels = block_kernels(q.device)
            dq, dk, dv = kernels.backward(dout, q, keys, values, final, total, True, scale)
        else:
            whole = Quarter(slice(0, q.shape[2]), slice(0, q.shape[2]), 0, 0, False)
            dq, dk, dv = quarter_backward(
                q.to(acc), keys.to(acc), values.to(acc), dout.to(acc), total, delta, whole,
                window, scale,
            )  # fmt: skip
        dk, dv = sum_groups(dk.to(acc), groups), sum_groups(dv.to(acc), groups)
        dsink = -(torch.exp(sink.to(acc)[None, :, None] - total) * delta).sum(dim=(0, 2))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink.to(sink.dtype), None


def sink_attention(q, k, v, sink: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Causal attention [b, heads, s, d] (k, v: [b, groups, s, d]) with a sink logit per head
    (`sink` [heads]), optionally within a sliding window of `window` tokens back."""
    return _SinkAttention.apply(q, k, v, sink, window)
