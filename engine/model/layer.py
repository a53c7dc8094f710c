"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)); the MLP is a
mixture of experts (engine/model/moe/layer.py) where --moe-layer-freq says so. Selective
recomputation (--recompute-modules) reruns the norms, the dense MLP or the whole MoE layer in
backward where named; core attention, the experts' activation and the shared experts are
rerun where they are computed."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention import SelfAttention
from engine.model.context import BuildContext
from engine.model.latent_attention import LatentAttention
from engine.model.mlp import MLP
from engine.model.moe.layer import MoELayer
from parallel.random import checkpoint


class TransformerLayer(nn.Module):
    def __init__(self, ctx: BuildContext, layer_number: int, path: str | None = None):
        """path: the layer's place in the model, "layers.<layer_number>" unless another
        (multi-token prediction's)."""
        super().__init__()
        cfg = ctx.config
        self.ctx = ctx
        self.layer_number = layer_number
        self.input_layernorm = ctx.norm()
        attention = LatentAttention if cfg.multi_latent_attention else SelfAttention
        self.self_attention = attention(ctx, layer_number)
        self.pre_mlp_layernorm = ctx.norm()
        pattern = cfg.moe_layer_pattern(cfg.num_layers)
        # (a multi-token-prediction layer, numbered after the decoder's, is built as its last)
        is_moe = pattern[min(layer_number, len(pattern) - 1)]
        self.mlp = MoELayer(ctx, layer_number, path) if is_moe else MLP(ctx, layer_number)
        self.recompute = cfg.selective_modules

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.hidden_dropout(x, self.training)

    def _recomputed(self, module: str, function, x: torch.Tensor) -> torch.Tensor:
        """function(x), rerun in backward instead of kept when selective recomputation names
        `module` (--recompute-modules)."""
        if self.training and module in self.recompute:
            return checkpoint(function, self.ctx.tracker, x)
        return function(x)

    def forward(self, x: torch.Tensor, rotary=None, documents=None) -> torch.Tensor:
        normed = self._recomputed("layernorm", self.input_layernorm, x)
        x = x + self._dropout(self.self_attention(normed, rotary, documents))
        normed = self._recomputed("layernorm", self.pre_mlp_layernorm, x)
        mlp = "moe" if isinstance(self.mlp, MoELayer) else "mlp"
        return x + self._dropout(self._recomputed(mlp, self.mlp, normed))
