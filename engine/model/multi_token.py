"""Multi-token prediction (DeepSeek-V3's; megatron-core's MultiTokenPredictionBlock, with its
parameter names): D more layers on the last pipeline stage, sharing the model's embedding and
output layer.

Depth k (0-based here) normalises the embedding of each position's token k+1 places ahead
(`enorm`) and the hidden state from the depth before (`hnorm`; the decoder's output after its
final norm for the first), projects the two side by side back to the hidden size (`eh_proj`,
column-parallel, gathered), runs one transformer layer built as the decoder's last one is, and
normalises (`final_layernorm`); the shared output layer then predicts the token k+2 places
ahead. The targets and masks come with the micro-batch (engine/data/multi_token.py).

The depths' losses reach the gradient as megatron-core's MTPLossAutoScaler makes them: each
depth's masked mean over the micro-batch's positions (under --calculate-per-token-loss its sum,
divided with the main loss by the global batch's token count), their mean times
--mtp-loss-scaling-factor, differentiated with the main loss's factor
(engine/model/moe/aux_loss.py's AuxLossScale, set by each step) and attached to the main loss
without changing its value. Each depth's loss is reported beside the main one (`mtp_1 loss`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.context import BuildContext
from engine.model.layer import TransformerLayer
from engine.model.moe.aux_loss import attach_side_loss
from parallel.random import checkpoint
from parallel.tensor_parallel.regions import (
    gather_from_tensor_parallel_region,
    scatter_to_sequence_parallel_region,
)

TARGET_KEYS = ("mtp_tokens", "mtp_labels", "mtp_mask", "mtp_counts")


class MultiTokenLayer(nn.Module):
    def __init__(self, ctx: BuildContext, depth: int):
        super().__init__()
        cfg = ctx.config
        self.ctx = ctx
        self.enorm, self.hnorm = ctx.norm(), ctx.norm()
        h = cfg.hidden_size
        self.eh_proj = ctx.column_linear(f"mtp.layers.{depth}.eh_proj", 2 * h, h, bias=False)
        # numbered after the decoder's layers (its seeds and names differ from theirs), built
        # as the decoder's last layer is (dense or a mixture of experts)
        path = f"mtp.layers.{depth}.transformer_layer"
        self.transformer_layer = TransformerLayer(ctx, cfg.num_layers + depth, path)
        self.final_layernorm = ctx.norm()

    def forward(self, hidden, embedded, documents, *rotary) -> torch.Tensor:
        """hidden and embedded [s(/tp), b, h] -> this depth's normalised output, the same."""
        ctx = self.ctx
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x = gather_from_tensor_parallel_region(self.eh_proj(x), ctx.tp_group, ctx.times)
        if ctx.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, ctx.tp_group, ctx.times)
        x = self.transformer_layer(x, rotary or None, documents)
        return self.final_layernorm(x)


class MultiTokenPrediction(nn.Module):
    def __init__(self, ctx: BuildContext):
        super().__init__()
        self.ctx = ctx
        depths = ctx.config.mtp_depths
        self.layers = nn.ModuleList(MultiTokenLayer(ctx, depth) for depth in range(depths))

    def forward(self, token_losses, hidden, targets: dict, rotary, documents, embed, loss_of):
        """(token_losses with the depths' loss attached, their losses [D] as reported):
        `hidden` the decoder's normalised output, `embed(ids [b, s])` the model's embedding
        ([s(/tp), b, h]), `loss_of(hidden)` the output layer's token losses [b, s] of the
        labels it is given (module docstring)."""
        cfg, scale = self.ctx.config, self.ctx.moe_loss_scale
        recompute = cfg.recompute_granularity == "full" and self.training
        side, reports = token_losses.new_zeros(()), []
        for depth, layer in enumerate(self.layers):
            embedded = embed(targets["mtp_tokens"][..., depth])
            args = (hidden, embedded, documents, *(rotary or ()))
            hidden = checkpoint(layer, self.ctx.tracker, *args) if recompute else layer(*args)
            losses = loss_of(hidden, targets["mtp_labels"][..., depth])
            summed = (losses * targets["mtp_mask"][..., depth].to(losses.dtype)).sum()
            count = targets["mtp_counts"][depth].to(losses.dtype).clamp(min=1.0)
            reports.append((summed / count).detach())
            side = side + (summed if scale.per_token else summed / count)
        side = side * (cfg.mtp_loss_scaling_factor / len(self.layers))
        return attach_side_loss(token_losses, side, scale), torch.stack(reports)
