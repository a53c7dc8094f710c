"""One mixture-of-experts MLP (megatron-core's MoELayer): the shared experts (if any) on every
token, the router's choice of experts, the tokens grouped by expert, the experts, and the
outputs added back onto their tokens, plus the shared experts' output."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.context import BuildContext
from engine.model.mlp import MLP
from engine.model.moe.dispatch import (
    exchange,
    exchange_back,
    gather_expert_tp,
    permute,
    scatter_expert_tp,
    unpermute,
)
from engine.model.moe.experts import Experts
from engine.model.moe.router import Router
from parallel.random import checkpoint
from parallel.tensor_parallel.init import draw_full
from parallel.tensor_parallel.sharding import mark_tp_partial_grad


class SharedExperts(MLP):
    """The shared experts (one MLP of --moe-shared-expert-intermediate-size), with
    --moe-shared-expert-gate a sigmoid gate per token (gate_weight [1, h])."""

    def __init__(self, ctx: BuildContext, layer_number: int):
        cfg = ctx.config
        prefix = f"layers.{layer_number}.mlp.shared_experts"
        super().__init__(ctx, layer_number, prefix, cfg.moe_shared_expert_intermediate_size)
        self.gate_weight = None
        if cfg.moe_shared_expert_gate:
            seed = ctx.param_seed(f"{prefix}.gate_weight")
            gate = draw_full((1, cfg.hidden_size), ctx.init_method, seed, ctx.device)
            self.gate_weight = nn.Parameter(gate.to(ctx.device, ctx.params_dtype))
            if ctx.sequence_parallel:
                mark_tp_partial_grad(self.gate_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out


class MoELayer(nn.Module):
    def __init__(self, ctx: BuildContext, layer_number: int, path: str | None = None):
        """path: the layer's place in the model ("layers.<n>", or a multi-token-prediction
        layer's), under which its experts' checkpoint names go."""
        super().__init__()
        cfg = ctx.config
        self.cfg = cfg
        self.ctx = ctx
        self.router = Router(ctx, layer_number)
        local = cfg.num_experts // ctx.ep_size  # this rank's experts, by global index
        first = ctx.ep_rank * local
        # each expert split over the expert tensor-parallel group (whole at size 1), its
        # linears only multiplying: the layer gathers their rows and sums their outputs
        sharded = dataclasses.replace(
            ctx,
            tp_group=ctx.expert_tp_group,
            tp_size=ctx.expert_tp_size,
            sequence_parallel=False,
            tp_communication=False,
        )
        experts = range(first, first + local)
        self.experts = Experts(sharded, layer_number, experts, path or f"layers.{layer_number}")
        self.shared_experts = None
        if cfg.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExperts(ctx, layer_number)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s, b, h] -> [s, b, h]."""
        seq, batch, hidden = x.shape
        shared = None
        if self.shared_experts is not None:
            modules = self.cfg.selective_modules  # (inside a rerun MoE layer: rerun with it)
            if "shared_experts" in modules and "moe" not in modules and self.training:
                shared = checkpoint(self.shared_experts, self.ctx.tracker, x)
            else:
                shared = self.shared_experts(x)
        probs, routing_map = self.router(x)
        rows, row_probs, permutation = permute(x.reshape(-1, hidden), routing_map, probs)
        counts, ep, times = permutation.counts, self.ctx.ep_size, self.ctx.times
        if ep > 1:  # each row to the rank holding its expert
            rows, row_probs, moved = exchange(rows, row_probs, counts, self.ctx.ep_group, ep, times)
            counts = moved.counts
        etp, etp_group = self.ctx.expert_tp_size, self.ctx.expert_tp_group
        if etp > 1:  # the rows of every rank sharing these experts
            rows, row_probs, gathered = gather_expert_tp(
                rows, row_probs, counts, etp_group, etp, times
            )
            counts = gathered.counts
        if self.cfg.moe_apply_probs_on_input:
            rows = (row_probs.unsqueeze(-1) * rows).to(rows.dtype)
            row_probs = torch.ones_like(row_probs)
        out = self.experts(rows, counts, row_probs)
        if etp > 1:
            out = scatter_expert_tp(out, gathered, etp_group, times)
        if ep > 1:
            out = exchange_back(out, moved, self.ctx.ep_group, times)
        out = unpermute(out, permutation, seq * batch).to(x.dtype).reshape(seq, batch, hidden)
        return out if shared is None else out + shared
