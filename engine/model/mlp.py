"""The feed-forward block: column-parallel up projection, GELU, squared ReLU or a gated unit
(SwiGLU, or quick GEGLU with gpt-oss's clamp and offset), row-parallel down. The dense
layers' MLP, and each expert and the shared experts of an MoE layer (engine/model/moe/)."""

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
        self.gated, self.squared_relu = cfg.gated_linear_unit, cfg.squared_relu
        self.quick, self.offset = cfg.quick_geglu, cfg.glu_linear_offset
        self.clamp = cfg.activation_func_clamp_value
        self.ops = ctx.ops
        self.gelu_approximation = "tanh" if cfg.gelu_tanh else "none"
        prefix = prefix or f"layers.{layer_number}.mlp"
        self.linear_fc1 = ctx.column_linear(
            f"{prefix}.linear_fc1",
            cfg.hidden_size,
            2 * f if self.gated else f,
            bias=cfg.add_bias_linear,
            partition_sizes=[f, f] if self.gated else None,
            partition_names=[".gate", ".up"] if self.gated else None,
        )
        self.linear_fc2 = ctx.row_linear(
            f"{prefix}.linear_fc2", f, cfg.hidden_size, bias=cfg.add_bias_linear
        )

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """The activation between the projections: a gated unit, squared ReLU or GELU."""
        if self.gated and not self.quick and self.clamp is None and self.offset == 0.0:
            return self.ops.swiglu(h)  # (the fused kernel where there is one)
        if self.gated:  # megatron-core's unfused GLU: clamp, activation, offset
            gate, up = h.chunk(2, dim=-1)
            if self.clamp is not None:
                gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
            active = gate * torch.sigmoid(1.702 * gate) if self.quick else F.silu(gate)
            return active * (up + self.offset)
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
