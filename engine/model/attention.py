"""Causal self-attention with tensor-parallel heads and grouped-query attention.

The fused QKV projection is column-parallel with three logical parts (q: heads x d, k and v:
groups x d each), so every TP rank holds whole heads and whole key/value groups. The output
projection is row-parallel. The attention kernel is chosen per layer when the model is built
(engine/model/attention_kernel.py: SDPA, or FlexAttention for sliding windows on GPUs) and
named at start; under context parallelism, this rank's queries attend over the
whole sequence through parallel/context_parallel/attention.py (ring, all-to-all or all-gather).
Given the micro-batch's `Documents` (--reset-attention-mask), a token attends only within its
own document, on every one of these paths.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention_kernel import AttentionKernel, choose_document_kernel, choose_kernel
from engine.model.attention_sinks import AttentionSinks
from engine.model.context import BuildContext
from engine.model.document_attention import Documents
from engine.model.norm import Norm
from engine.model.qk_norm import ProjectionRMSNorm
from parallel.context_parallel.attention import context_parallel_attention
from parallel.random import checkpoint


class SelfAttention(nn.Module):
    def __init__(self, ctx: BuildContext, layer_number: int):
        super().__init__()
        cfg = ctx.config
        self.ctx = ctx
        d, n, g = cfg.head_dim, cfg.num_attention_heads, cfg.query_groups
        self.head_dim = d
        self.layer_number = layer_number
        self.local_heads = n // ctx.tp_size
        self.local_groups = g // ctx.tp_size
        prefix = f"layers.{layer_number}.self_attention"
        self.linear_qkv = ctx.column_linear(
            f"{prefix}.linear_qkv",
            cfg.hidden_size,
            (n + 2 * g) * d,
            bias=cfg.add_bias_linear or cfg.add_qkv_bias,
            partition_sizes=[n * d, g * d, g * d],
            partition_names=[".q", ".k", ".v"],
        )
        self.linear_proj = ctx.row_linear(
            f"{prefix}.linear_proj", n * d, cfg.hidden_size, bias=cfg.add_bias_linear
        )
        self.across_heads = cfg.qk_layernorm and cfg.qk_layernorm_across_heads
        if self.across_heads:  # one norm over all heads (OLMoE), split with them over TP
            kwargs = {"params_dtype": ctx.params_dtype, "device": ctx.device}
            kwargs |= {"zero_centered": cfg.apply_layernorm_1p, "times": ctx.times}
            eps, group = cfg.norm_epsilon, ctx.tp_group
            self.q_layernorm = ProjectionRMSNorm(n * d, eps, group, **kwargs)
            self.k_layernorm = ProjectionRMSNorm(g * d, eps, group, **kwargs)
        elif cfg.qk_layernorm:
            partial = ctx.tp_size > 1  # each TP rank normalises different heads
            kwargs = {
                "params_dtype": ctx.params_dtype,
                "device": ctx.device,
                "ops": ctx.ops,
                "zero_centered": cfg.apply_layernorm_1p,
            }
            self.q_layernorm = Norm(cfg.normalization, d, cfg.norm_epsilon, partial, **kwargs)
            self.k_layernorm = Norm(cfg.normalization, d, cfg.norm_epsilon, partial, **kwargs)
        else:
            self.q_layernorm = self.k_layernorm = None
        self._build_core(grouped=n != g)

    def _build_core(self, grouped: bool) -> None:
        """The attention proper between the projections: its kernel (chosen for the device,
        window, grouping, dropout and sinks), its sink logits, selective recomputation."""
        ctx, cfg, layer_number = self.ctx, self.ctx.config, self.layer_number
        self.selective_recompute = "core_attn" in cfg.selective_modules
        self.window = cfg.window_of(layer_number)  # --window-size, --window-attn-skip-freq
        self.core_attention = None
        if cfg.has_sinks:
            name = f"layers.{layer_number}.self_attention.core_attention.softmax_offset"
            heads = cfg.num_attention_heads
            self.core_attention = AttentionSinks(ctx, name, heads, cfg.softmax_type)
        kind = choose_kernel(
            ctx.device, ctx.params_dtype, grouped, self.window, cfg.attention_dropout,
            cfg.has_sinks,
        )  # fmt: skip
        document_kind = choose_document_kernel(ctx.device, cfg.attention_dropout)
        self.kernel = AttentionKernel(
            kind, self.window, grouped, ctx.attention_masks, document_kind
        )

    def _sink(self) -> torch.Tensor | None:
        return self.core_attention() if self.core_attention is not None else None

    def _core(self, q, k, v, documents: Documents | None = None) -> torch.Tensor:
        ctx = self.ctx
        if ctx.cp_size == 1:
            return self._attend(q, k, v, documents)
        comm_type = ctx.cp_comm_type_of(self.layer_number)
        window = self.window
        ids = documents.ids if documents is not None else None
        chunks = documents.chunks(ctx.cp_size) if documents is not None else None

        # a2a: whole sequences in natural order for this CP rank's block of the heads (and of
        # their sink logits; each CP rank's gradient is then its block's, and the DP x CP
        # reduction adds them up)
        heads = q.shape[1] // ctx.cp_size
        block = slice(ctx.cp_rank * heads, (ctx.cp_rank + 1) * heads)

        def attend(q, k, v):
            return self._attend(q, k, v, documents, block)

        sink = None if comm_type == "a2a" else self._sink()
        return context_parallel_attention(
            q, k, v, ctx.cp_group, comm_type, window, attend, ids, chunks, sink
        )

    def _attend(
        self, q, k, v, documents: Documents | None = None, heads: slice | None = None
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v over whole sequences [b, heads, s, d], causal (within
        documents where they are given), with dropout drawn from the per-TP-rank stream (heads
        are split over TP); `heads`: which of the layer's heads (and sink logits) q holds."""
        p = self.ctx.config.attention_dropout if self.training else 0.0
        sink = self._sink()
        if sink is not None and heads is not None:
            sink = sink[heads]
        if p > 0.0 and self.ctx.tracker is not None:
            with self.ctx.tracker.fork():
                return self.kernel(q, k, v, p, documents, sink)
        return self.kernel(q, k, v, p, documents, sink)

    def _keeps_little(self) -> bool:
        """Ring attention keeps only q, k, v, output and log-sum-exp for backward: selective
        recomputation would rerun its whole ring to save nothing."""
        ctx = self.ctx
        return ctx.cp_size > 1 and ctx.cp_comm_type_of(self.layer_number) == "p2p"

    def _core_maybe_recomputed(self, q, k, v, documents: Documents | None):
        """The core attention, rerun in backward where --recompute-modules names core_attn."""
        if self.selective_recompute and self.training and not self._keeps_little():
            return checkpoint(self._core, self.ctx.tracker, q, k, v, documents)
        return self._core(q, k, v, documents)

    def _rotate(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on the first channels of each head that the tables cover (all of them unless
        --rotary-percent is below 1); the rest pass through unrotated."""
        width = rotary[0].shape[-1]
        if width == x.shape[-1]:
            return self._rotate_all(x, rotary)
        turned = self._rotate_all(x[..., :width].contiguous(), rotary)
        return torch.cat([turned, x[..., width:]], dim=-1)

    def _rotate_all(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
        """With --rotary-interleaved, pair (2i, 2i+1) turns as the halves' pair (i, i + d/2)
        does: the channels are reordered into halves, turned by the same op, put back."""
        if not self.ctx.config.rotary_interleaved:
            return self.ctx.ops.rotary(x, *rotary)
        width = x.shape[-1]
        halves = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1).contiguous()
        turned = self.ctx.ops.rotary(halves, *rotary)
        out = torch.empty_like(turned)
        out[..., 0::2], out[..., 1::2] = turned[..., : width // 2], turned[..., width // 2 :]
        return out

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        documents: Documents | None = None,
    ):
        qkv = self.linear_qkv(x)  # [s, b, (heads + 2 groups) * d / tp]
        s, b = qkv.shape[:2]
        d, nh, ng = self.head_dim, self.local_heads, self.local_groups
        q, k, v = qkv.split([nh * d, ng * d, ng * d], dim=-1)
        if self.across_heads:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k, v = q.reshape(s, b, nh, d), k.reshape(s, b, ng, d), v.view(s, b, ng, d)
        if self.q_layernorm is not None and not self.across_heads:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            q, k = self._rotate(q, rotary), self._rotate(k, rotary)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        out = self._core_maybe_recomputed(q, k, v, documents)
        out = out.permute(2, 0, 1, 3).reshape(s, b, nh * d)
        return self.linear_proj(out)
