"""Multi-latent attention (DeepSeek-V2/V3), with megatron-core's parameter names and meaning.

Per token, a replicated down projection makes the key/value latent (--kv-lora-rank channels)
and one RoPE key of --qk-pos-emb-head-dim channels shared by every head; queries come from the
hidden state through a replicated query latent (--q-lora-rank) or directly. The latents are
normalised (--qk-layernorm) and projected up per head by column-parallel linears, so each TP
rank makes its own heads' queries, keys and values; the output projection is row-parallel, as
in SelfAttention (engine/model/attention.py), whose core attention this reuses (kernels,
documents, context parallelism).

Under sequence parallelism the down projections and the latent norms work on this rank's part
of the sequence (their gradients are summed over TP), the up projections gather it, and the
shared RoPE key is gathered along the sequence. RoPE pairs each head's channel 2i with 2i+1
(megatron-core's MLA reorders them into halves first; DeepSeek's checkpoints are laid out so).

With --recompute-modules mla_up_proj, the up projections and RoPE are run without keeping
anything but the latents, their outputs (the full queries, keys and values) are freed once core
attention has run, and recomputed just before its backward (parallel/discarded_outputs.py):
the memory MLA saves. Context parallelism exchanges keys and values around the ring only, as
megatron-core allows for MLA. Where a kernel needs queries, keys and values of one width (the
ring's, the CPU's flash kernel) the values are padded with zeros to the query width
(`padded_width`); CUDA's fused kernels take them as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import SelfAttention
from engine.model.context import BuildContext
from engine.model.document_attention import Documents
from parallel.discarded_outputs import OutputDiscarding
from parallel.tensor_parallel.init import draw_full
from parallel.tensor_parallel.regions import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
)
from parallel.tensor_parallel.sharding import mark_tp_partial_grad


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every TP rank (megatron-core's "duplicated" linear); its
    gradient is summed over TP under sequence parallelism, where each rank sees its part of
    the sequence."""

    def __init__(self, ctx: BuildContext, name: str, input_size: int, output_size: int):
        super().__init__()
        seed = ctx.param_seed(f"{name}.weight")
        weight = draw_full((output_size, input_size), ctx.init_method, seed, ctx.device)
        self.weight = nn.Parameter(weight.to(ctx.device, ctx.params_dtype))
        if ctx.sequence_parallel:
            mark_tp_partial_grad(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def padded_width(cfg, device, cp_size: int) -> int | None:
    """The one head width queries, keys and values are padded to (with zeros, which change
    no score and no output), or None: under context parallelism (the ring's kernels) and on
    the CPU (whose flash kernel) the three must be as wide; CUDA's fused kernels take
    narrower values as they are."""
    widths = (cfg.latent_query_head_dim, cfg.v_head_dim)
    if widths[0] == widths[1] or (cp_size == 1 and torch.device(device).type == "cuda"):
        return None
    return max(widths)


class LatentAttention(SelfAttention):
    def __init__(self, ctx: BuildContext, layer_number: int):
        nn.Module.__init__(self)
        cfg = ctx.config
        self.ctx, self.layer_number = ctx, layer_number
        n, h = cfg.num_attention_heads, cfg.hidden_size
        self.local_heads = n // ctx.tp_size
        self.qk_dim, self.pos_dim, self.v_dim = (
            cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        )  # fmt: skip
        query_dim = cfg.latent_query_head_dim
        prefix = f"layers.{layer_number}.self_attention"
        self.linear_q_proj = self.linear_q_down_proj = self.linear_q_up_proj = None
        self.q_layernorm = self.kv_layernorm = None
        if cfg.q_lora_rank is None:
            self.linear_q_proj = ctx.column_linear(
                f"{prefix}.linear_q_proj", h, n * query_dim, bias=False
            )
        else:
            self.linear_q_down_proj = ReplicatedLinear(
                ctx, f"{prefix}.linear_q_down_proj", h, cfg.q_lora_rank
            )
            self.linear_q_up_proj = ctx.column_linear(
                f"{prefix}.linear_q_up_proj", cfg.q_lora_rank, n * query_dim, bias=False
            )
            if cfg.qk_layernorm:
                self.q_layernorm = ctx.norm(cfg.q_lora_rank)
        self.linear_kv_down_proj = ReplicatedLinear(
            ctx, f"{prefix}.linear_kv_down_proj", h, cfg.kv_lora_rank + self.pos_dim
        )
        self.linear_kv_up_proj = ctx.column_linear(
            f"{prefix}.linear_kv_up_proj",
            cfg.kv_lora_rank,
            n * (self.qk_dim + self.v_dim),
            bias=False,
        )
        if cfg.qk_layernorm:
            self.kv_layernorm = ctx.norm(cfg.kv_lora_rank)
        self.linear_proj = ctx.row_linear(
            f"{prefix}.linear_proj", n * self.v_dim, h, bias=cfg.add_bias_linear
        )
        self.width = padded_width(cfg, ctx.device, ctx.cp_size)
        # the kernels scale by 1 / sqrt(width of q); the queries carry the rest of MLA's scale
        width = self.width or query_dim
        self.query_scale = cfg.latent_softmax_scale() * math.sqrt(width)
        self.recompute_up = "mla_up_proj" in cfg.selective_modules
        self._build_core(grouped=False)

    def _whole_sequence(self, k_pos: torch.Tensor) -> torch.Tensor:
        """The shared RoPE key for every token this rank's heads attend from: gathered along
        the sequence under SP; its gradient, to which every rank's heads add, summed."""
        ctx = self.ctx
        if ctx.tp_size == 1:
            return k_pos
        if ctx.sequence_parallel:
            return gather_from_sequence_parallel_region(k_pos, ctx.tp_group, True, ctx.times)
        return copy_to_tensor_parallel_region(k_pos, ctx.tp_group, ctx.times)

    def _latents(self, x: torch.Tensor):
        """(query latent, key/value latent, shared RoPE key) of the hidden states x; each its
        own tensor, so that keeping one keeps no other (the down projection's output is one)."""
        cfg = self.ctx.config
        q_latent = x
        if self.linear_q_down_proj is not None:
            q_latent = self.linear_q_down_proj(x)
            if self.q_layernorm is not None:
                q_latent = self.q_layernorm(q_latent)
        kv_latent, k_pos = self.linear_kv_down_proj(x).split(
            [cfg.kv_lora_rank, self.pos_dim], dim=-1
        )
        if self.kv_layernorm is not None:
            kv_latent = self.kv_layernorm(kv_latent)
        return q_latent, kv_latent.contiguous(), self._whole_sequence(k_pos).contiguous()

    def _turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on channel pairs (2i, 2i+1), taken into halves first (module docstring)."""
        halves = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1).contiguous()
        return self.ctx.ops.rotary(halves, cos, sin)

    def _up(self, q_latent, kv_latent, k_pos, cos, sin):
        """Queries, keys and values [b, heads, s, d] of this rank's heads from the latents."""
        up = self.linear_q_proj if self.linear_q_proj is not None else self.linear_q_up_proj
        q = up(q_latent)
        s, b = q.shape[:2]
        nh, qk, pos = self.local_heads, self.qk_dim, self.pos_dim
        q_plain, q_pos = q.view(s, b, nh, qk + pos).split([qk, pos], dim=-1)
        kv = self.linear_kv_up_proj(kv_latent).view(s, b, nh, qk + self.v_dim)
        k_plain, value = kv.split([qk, self.v_dim], dim=-1)
        k_pos = self._turn(k_pos.unsqueeze(2), cos, sin).expand(s, b, nh, pos)
        query = torch.cat([q_plain, self._turn(q_pos, cos, sin)], dim=-1)
        key = torch.cat([k_plain, k_pos], dim=-1)
        if self.query_scale != 1.0:
            query = query * self.query_scale
        if self.width is not None:  # one width for the kernels (padded_width)
            query, key, value = (
                F.pad(t, (0, self.width - t.shape[-1])) for t in (query, key, value)
            )
        return tuple(t.permute(1, 2, 0, 3).contiguous() for t in (query, key, value))

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        documents: Documents | None = None,
    ):
        args = (*self._latents(x), *rotary)
        discarding = OutputDiscarding() if self.recompute_up and self.training else None
        q, k, v = discarding.run(self._up, *args) if discarding else self._up(*args)
        out = self._core_maybe_recomputed(q, k, v, documents)
        if discarding is not None:
            discarding.discard(out)
        b, _, s, _ = out.shape
        out = out[..., : self.v_dim].permute(2, 0, 1, 3).reshape(s, b, -1)
        return self.linear_proj(out)
