"""The feed-forward block: column-parallel up projection, GELU, squared ReLU or SwiGLU,
row-parallel down. The dense layers' MLP, and each expert and the shared experts of an MoE
layer (engine/model/moe/)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.context import BuildContext


class MLP(nn.Module):
    """The MLP whose weights are the global parameters `prefix`.linear_fc1/2 (default
    layers.N.mlp), of hidden size `ffn_size` (default the model's)."""

    def __init__(
        self,
        ctx: BuildContext,
        layer_number: int,
        prefix: str | None = None,
        ffn_size: int | None = None,
    ):
        super().__init__()
        cfg = ctx.config
        f = ffn_size or cfg.ffn_size
        self.swiglu, self.squared_relu = cfg.swiglu, cfg.squared_relu
        self.ops = ctx.ops
        self.gelu_approximation = "tanh" if cfg.gelu_tanh else "none"
        prefix = prefix or f"layers.{layer_number}.mlp"
        self.linear_fc1 = ctx.column_linear(
            f"{prefix}.linear_fc1",
            cfg.hidden_size,
            2 * f if cfg.swiglu else f,
            bias=cfg.add_bias_linear,
            partition_sizes=[f, f] if cfg.swiglu else None,
            partition_names=[".gate", ".up"] if cfg.swiglu else None,
        )
        self.linear_fc2 = ctx.row_linear(
            f"{prefix}.linear_fc2", f, cfg.hidden_size, bias=cfg.add_bias_linear
        )

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """The activation between the projections: SwiGLU, squared ReLU or GELU."""
        if self.swiglu:
            return self.ops.swiglu(h)
        if self.squared_relu:
            return F.relu(h).square()
        return F.gelu(h, approximate=self.gelu_approximation)

    def forward(self, x: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        """`probs` [tokens] (an expert's): each token's output is scaled by its router
        probability, applied after the activation (and to the down projection's bias), as
        megatron-core's experts apply it."""
        h = self.activate(self.linear_fc1(x))
        if probs is None:
            return self.linear_fc2(h)
        scale = probs.unsqueeze(-1)
        return self.linear_fc2((h * scale).to(h.dtype), bias_scale=scale)
