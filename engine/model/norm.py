"""LayerNorm and RMSNorm, replicated over the TP group."""

from __future__ import annotations

import torch
from torch import nn

from engine.ops.torch_ops import TorchOps
from parallel.sharding import mark_tp_partial_grad


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
        ops=None,
    ):
        super().__init__()
        self.ops = ops or TorchOps()
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
            return self.ops.layer_norm(x, self.weight, self.bias, self.eps)
        return self.ops.rms_norm(x, self.weight, self.eps)
