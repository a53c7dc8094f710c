"""Queries and keys normalised over all heads at once (--qk-layernorm-across-heads, OLMoE's
q_norm and k_norm): one RMSNorm over each token's whole query projection and one over its key
projection, where --qk-layernorm alone normalises each head on its own.

Tensor parallelism splits the heads, so each rank holds part of a token's projection: its sum
of squares is added over the TP group (an all-reduce forward, and backward, since every rank's
heads depend on the sum), and the weight is split with its heads (a whole-tensor checkpoint key,
each rank's gradient complete for its part). Computed in fp32 and cast back, as HF's RMSNorm.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.comm import group_rank, group_size
from parallel.tensor_parallel.regions import sum_over_tensor_parallel_region
from parallel.tensor_parallel.sharding import set_tp_sharding, split_sharding


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a projection of `width` channels (all heads), this rank's heads held."""

    def __init__(
        self,
        width: int,
        eps: float,
        tp_group=None,
        params_dtype: torch.dtype = torch.float32,
        device=None,
        zero_centered: bool = False,
        times=None,
    ):
        super().__init__()
        self.tp_group, self.times = tp_group, times
        size, rank = group_size(tp_group), group_rank(tp_group)
        self.width, self.eps, self.zero_centered = width, eps, zero_centered
        initial = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(initial(width // size, dtype=params_dtype, device=device))
        set_tp_sharding(self.weight, split_sharding(0, [width], rank, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., width / TP] -> normalised by the root mean square over all `width`."""
        dtype = x.dtype
        x32 = x.float()
        squares = x32.pow(2).sum(-1, keepdim=True)
        if group_size(self.tp_group) > 1:  # (counted as tp-comm in the time breakdown)
            squares = sum_over_tensor_parallel_region(squares, self.tp_group, self.times)
        x32 = x32 * torch.rsqrt(squares / self.width + self.eps)
        weight = self.weight + 1 if self.zero_centered else self.weight
        return weight * x32.to(dtype)
