"""The MoE router (megatron-core's TopKRouter): a linear gate [E, h] scores every token, the
top-k experts are chosen (engine/model/moe/routing.py) and the load-balancing and z losses are
attached to the gradient (engine/model/moe/aux_loss.py).

Token sets: a rank routes its own tokens. Counts a loss needs over more tokens (the tokens per
expert of aux_loss over the sequence's ranks, TP under sequence parallelism and CP; those of
global_aux_loss also over DP) are summed over those groups, so each rank's loss is its tokens'
share of the loss over the whole set and the shares add up in the gradient reduction.

The expert bias (--moe-router-enable-expert-bias) is a parameter without gradient (saved with
the model); `tokens_seen` counts the tokens each expert received in this step's training
forwards, from which `end_step` moves the bias after the step. `step_stats` keeps what the
step's training forwards saw for the logs (engine/model/moe/stats.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.model.context import BuildContext
from engine.model.moe.aux_loss import attach_loss
from engine.model.moe.routing import (
    aux_loss_scores,
    drop_over_capacity,
    sinkhorn_routing,
    switch_aux_loss,
    topk_routing,
    z_loss,
)
from engine.model.moe.stats import RouterStepStats
from parallel.comm import all_reduce, group_size
from parallel.tensor_parallel.init import draw_full
from parallel.tensor_parallel.sharding import mark_tp_partial_grad


def router_dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    """--moe-router-dtype's dtype (the input's without it)."""
    return {"fp32": torch.float32, "fp64": torch.float64}.get(name, default)


class _Gate(torch.autograd.Function):
    """x @ W^T (+ b) computed in `dtype`, keeping x and W as they are for backward (not their
    fp32/fp64 copies), the gradients returned in their dtypes: megatron-core's
    router_gating_linear."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        ctx.save_for_backward(x, weight)
        ctx.dtype, ctx.has_bias = dtype, bias is not None
        logits = x.to(dtype) @ weight.to(dtype).t()
        return logits + bias.to(dtype) if bias is not None else logits

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = (grad @ weight.to(ctx.dtype)).to(x.dtype)
        grad_w = (flat.t() @ x.reshape(-1, x.shape[-1]).to(ctx.dtype)).to(weight.dtype)
        grad_b = flat.sum(dim=0).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class Router(nn.Module):
    def __init__(self, ctx: BuildContext, layer_number: int):
        super().__init__()
        cfg = ctx.config
        self.ctx, self.cfg, self.layer_number = ctx, cfg, layer_number
        prefix = f"layers.{layer_number}.mlp.router"
        experts, h = cfg.num_experts, cfg.hidden_size
        weight = draw_full(
            (experts, h), ctx.init_method, ctx.param_seed(f"{prefix}.weight"), ctx.device
        )
        self.weight = nn.Parameter(weight.to(ctx.device, ctx.params_dtype))
        self.bias = None
        if cfg.add_bias_linear:  # megatron-core draws it with the weights' initialisation
            bias = draw_full(
                (1, experts), ctx.init_method, ctx.param_seed(f"{prefix}.bias"), ctx.device
            )
            self.bias = nn.Parameter(bias.reshape(experts).to(ctx.device, ctx.params_dtype))
        for param in (self.weight, self.bias):
            if param is not None and ctx.sequence_parallel:
                mark_tp_partial_grad(param)  # each TP rank routes its part of the sequence
        self.expert_bias = None
        if cfg.moe_router_enable_expert_bias:
            zeros = torch.zeros(experts, dtype=torch.float32, device=ctx.device)
            self.expert_bias = nn.Parameter(zeros, requires_grad=False)
            self.tokens_seen = torch.zeros(experts, dtype=torch.float32, device=ctx.device)
        self.global_counts = None  # global_aux_loss: this step's tokens per expert so far
        self.global_forwards = 0
        # the last training forward's losses over their coefficients (megatron-core's names)
        self.recorded: dict[str, torch.Tensor] = {}
        # what this step's training forwards saw (engine/monitor/moe_metrics.py)
        self.step_stats = RouterStepStats(experts, cfg.moe_router_topk, ctx.device)

    # --- the token sets -----------------------------------------------------------------

    def _sequence_groups(self) -> list:
        """The groups whose ranks hold other tokens of the same sequences."""
        groups = [self.ctx.cp_group]
        if self.ctx.sequence_parallel:
            groups.append(self.ctx.tp_group)
        return [g for g in groups if g is not None]

    def _summed(self, counts: torch.Tensor, groups: list) -> tuple[torch.Tensor, int]:
        """(counts summed over the groups, how many ranks' token sets that joins)."""
        counts = counts.clone()
        for group in groups:
            all_reduce(counts, group)
        return counts, _ranks(groups)

    # --- forward --------------------------------------------------------------------------

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        dtype = router_dtype(self.cfg.moe_router_dtype, x.dtype)
        return _Gate.apply(x, self.weight, self.bias, dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [s, b, h] -> (probs [s*b, E], routing map [s*b, E]); tokens in [s, b] order."""
        cfg = self.cfg
        seq, batch = x.shape[:2]
        learning = self.training and torch.is_grad_enabled()
        if learning:
            self.recorded = {}
        if cfg.moe_input_jitter_eps is not None:  # (in evaluation too, as megatron-core)
            x = x * _jitter(x, cfg.moe_input_jitter_eps)
        logits = self.gating(x).reshape(seq * batch, cfg.num_experts)
        if learning and cfg.moe_z_loss_coeff:
            ranks = _ranks(self._sequence_groups())
            loss = z_loss(logits, cfg.moe_z_loss_coeff / ranks)  # its share of the mean
            self.recorded["z_loss"] = loss.detach() / cfg.moe_z_loss_coeff
            logits = attach_loss(logits, loss, self.ctx.moe_loss_scale)
        if cfg.uses_sinkhorn:
            probs, routing_map = sinkhorn_routing(logits, cfg.moe_router_topk, self.training)
        else:
            probs, routing_map = topk_routing(
                logits,
                cfg.moe_router_topk,
                score_function=cfg.moe_router_score_function,
                pre_softmax=cfg.moe_router_pre_softmax,
                num_groups=cfg.moe_router_num_groups,
                group_topk=cfg.moe_router_group_topk,
                scaling_factor=cfg.moe_router_topk_scaling_factor,
                expert_bias=self.expert_bias,
            )
        chosen = routing_map
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_over_capacity(
                probs,
                routing_map,
                cfg.moe_router_topk,
                cfg.moe_expert_capacity_factor,
                cfg.moe_token_drop_policy,
                cfg.moe_pad_expert_input_to_capacity,
            )
        if learning and any(cfg.aux_loss_coeff(k) for k in ("aux_loss", "seq_aux_loss")):
            probs = self._balancing_losses(probs, logits, seq, batch)
        if learning and cfg.aux_loss_coeff("global_aux_loss"):
            probs = self._global_loss(probs, logits)
        if learning and self.expert_bias is not None:
            self.tokens_seen += routing_map.sum(dim=0)
        if learning:
            self.step_stats.add(self.recorded, routing_map, (chosen & ~routing_map).sum())
        return probs, routing_map

    def _balancing_losses(self, probs, logits, seq: int, batch: int) -> torch.Tensor:
        cfg, topk, experts = self.cfg, self.cfg.moe_router_topk, self.cfg.num_experts
        aux_map, scores = aux_loss_scores(logits, topk, cfg.moe_router_score_function)
        groups = self._sequence_groups()
        coeff = cfg.aux_loss_coeff("aux_loss")
        if coeff:
            counts, ranks = self._summed(aux_map.sum(dim=0), groups)
            total = aux_map.shape[0] * ranks
            loss = switch_aux_loss(scores, counts, total, topk, experts, coeff)
            self.recorded["load_balancing_loss"] = loss.detach() / coeff
            probs = attach_loss(probs, loss, self.ctx.moe_loss_scale)
        coeff = cfg.aux_loss_coeff("seq_aux_loss")
        if coeff:  # each sequence its own token set: [s, b x E], the loss summed, / b
            per_sequence = aux_map.reshape(seq, batch * experts)
            counts, ranks = self._summed(per_sequence.sum(dim=0), groups)
            loss = switch_aux_loss(
                scores.reshape(seq, batch * experts), counts, seq * ranks, topk, experts, coeff
            )
            self.recorded["seq_load_balancing_loss"] = loss.detach() / batch / coeff
            probs = attach_loss(probs, loss / batch, self.ctx.moe_loss_scale)
        return probs

    def _global_loss(self, probs, logits) -> torch.Tensor:
        """global_aux_loss: the tokens per expert of every micro-batch of the step so far over
        all data-parallel ranks too, averaged over the micro-batches. Each DP rank's loss is
        its share of the loss over all of them; the data-parallel reduction averages the
        gradients, so the share is differentiated DP times over, and the loss reaches the
        gradient once, as it would in one process (megatron-core averages the shares: its
        loss's gradient is 1/DP of that)."""
        cfg, topk = self.cfg, self.cfg.moe_router_topk
        aux_map, scores = aux_loss_scores(logits, topk, cfg.moe_router_score_function)
        tp = self.ctx.tp_group if self.ctx.sequence_parallel else None
        groups = [g for g in (self.ctx.dp_cp_group, tp) if g is not None]  # DP x CP (x TP)
        counts, ranks = self._summed(aux_map.sum(dim=0).float(), groups)
        if self.global_counts is None:
            self.global_counts = torch.zeros_like(counts)
        self.global_counts += counts
        self.global_forwards += 1
        coeff = cfg.aux_loss_coeff("global_aux_loss")
        loss = switch_aux_loss(
            scores,
            self.global_counts / self.global_forwards,
            aux_map.shape[0] * ranks,
            topk,
            cfg.num_experts,
            coeff,
        )
        self.recorded["global_load_balancing_loss"] = loss.detach() / coeff
        data_parallel = group_size(self.ctx.dp_cp_group) // self.ctx.cp_size
        return attach_loss(probs, loss * data_parallel, self.ctx.moe_loss_scale)

    # --- after the step ---------------------------------------------------------------------

    @torch.no_grad()
    def end_step(self, tp_group, dp_cp_group) -> None:
        """After a training step's backward: move the expert bias by the step's token counts
        over every rank holding this layer (TP x DP x CP; the same new bias on each) and start
        the next step's counts. Collective over those ranks."""
        self.global_counts, self.global_forwards = None, 0
        self.step_stats = RouterStepStats(
            self.cfg.num_experts, self.cfg.moe_router_topk, self.step_stats.counts.device
        )
        if self.expert_bias is None:
            return
        counts = self.tokens_seen
        for group in (tp_group, dp_cp_group):  # TP x DP x CP, as megatron-core
            if group is not None:
                dist.all_reduce(counts, group=group)
        offset = counts.mean() - counts
        self.expert_bias += torch.sign(offset) * self.cfg.moe_router_bias_update_rate
        counts.zero_()


def _ranks(groups: list) -> int:
    """How many ranks the groups join (each rank in one group of each)."""
    ranks = 1
    for group in groups:
        ranks *= group_size(group)
    return ranks


def routers_of(chunks) -> list[Router]:
    """The MoE routers of the model chunks (DDP-wrapped or not), in order."""
    modules = [chunk.module if hasattr(chunk, "module") else chunk for chunk in chunks]
    return [m for module in modules for m in module.modules() if isinstance(m, Router)]


def _jitter(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Multipliers drawn uniformly from [1 - eps, 1 + eps) in x's dtype, from the default
    generator, drawn and scaled as megatron-core's Uniform(1 - eps, 1 + eps).rsample does (the
    same numbers from the same seed)."""
    low = torch.tensor(1.0 - eps, dtype=x.dtype, device=x.device)
    high = torch.tensor(1.0 + eps, dtype=x.dtype, device=x.device)
    return low + torch.rand(x.shape, dtype=x.dtype, device=x.device) * (high - low)
