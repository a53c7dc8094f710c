"""LayerNorm and RMSNorm, replicated over the TP group."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel.sharding import mark_tp_partial_grad


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, computed in fp32 and cast back (as Llama does)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class Norm(nn.Module):
    """LayerNorm (weight and bias) or RMSNorm (weight only) over the last dimension.

    partial_grad marks the parameters whose gradient differs per TP rank (they see
    sequence-split activations under SP, or different heads for QK norms)."""

    def __init__(
        self,
        kind: str,
        size: int,
        eps: float,
        partial_grad: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        if kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"unknown normalization {kind}")
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(size, dtype=params_dtype, device=device))
        if kind == "LayerNorm":
            self.bias = nn.Parameter(torch.zeros(size, dtype=params_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        if partial_grad:
            for param in self.parameters():
                mark_tp_partial_grad(param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "LayerNorm":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        return rms_norm(x, self.weight, self.eps)
