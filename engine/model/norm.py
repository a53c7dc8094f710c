"""LayerNorm and RMSNorm, replicated over the TP group."""

from __future__ import annotations

import torch
from torch import nn

from engine.ops.torch_ops import TorchOps
from parallel.tensor_parallel.sharding import mark_tp_partial_grad


class Norm(nn.Module):
    """LayerNorm (weight and bias) or RMSNorm (weight only) over the last dimension.

    partial_grad marks the parameters whose gradient differs per TP rank (they see
    sequence-split activations under SP, or different heads for QK norms). zero_centered
    (Megatron-LM's --apply-layernorm-1p) stores the weight centred on zero, initialised to 0
    and applied as 1 + weight."""

    def __init__(
        self,
        kind: str,
        size: int,
        eps: float,
        partial_grad: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device=None,
        ops=None,
        zero_centered: bool = False,
    ):
        super().__init__()
        self.ops = ops or TorchOps()
        if kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"unknown normalization {kind}")
        self.kind, self.eps, self.zero_centered = kind, eps, zero_centered
        initial = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(initial(size, dtype=params_dtype, device=device))
        if kind == "LayerNorm":
            self.bias = nn.Parameter(torch.zeros(size, dtype=params_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        if partial_grad:
            for param in self.parameters():
                mark_tp_partial_grad(param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        if self.kind == "LayerNorm":
            return self.ops.layer_norm(x, weight, self.bias, self.eps)
        return self.ops.rms_norm(x, weight, self.eps)
