"""The multi-latent attention part of the model's config (`LatentAttentionOptions`, which
`ModelConfig` extends): DeepSeek-V2/V3's attention, with Megatron-LM's flag names, meanings and
defaults (megatron-core 0.16.1), and its checks.

Each token's keys and values come from one small latent of --kv-lora-rank channels (its
"compressed" key/value), projected up per head into --qk-head-dim key channels and
--v-head-dim value channels; --qk-pos-emb-head-dim more key channels carry RoPE and are shared
by every head (the decoupled RoPE part). Queries come from the hidden state directly, or
through a latent of --q-lora-rank channels. With --qk-layernorm the two latents are
normalised (megatron-core's q_layernorm and kv_layernorm; DeepSeek-V3 has both).

RoPE inside it is YaRN by default (`--rope-type`, as megatron-core: a factor of
--rotary-scaling-factor 1 leaves plain RoPE), and the softmax scale is
mscale(factor, --mscale-all-dim)^2 / sqrt(qk-head-dim + qk-pos-emb-head-dim).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError


@dataclass(frozen=True)
class LatentAttentionOptions:
    """Multi-latent attention (MLA)."""

    multi_latent_attention: bool = option(
        False,
        "multi-latent attention (DeepSeek-V2/V3): keys and values projected up from a small "
        "per-token latent; see --kv-lora-rank, --q-lora-rank, --qk-head-dim, "
        "--qk-pos-emb-head-dim, --v-head-dim",
    )
    q_lora_rank: int | None = option(
        None,
        "with --multi-latent-attention: channels of the query latent (default: none, the "
        "queries are projected from the hidden state directly)",
    )
    kv_lora_rank: int = option(
        32, "with --multi-latent-attention: channels of the key/value latent"
    )
    qk_head_dim: int = option(
        128, "with --multi-latent-attention: query/key channels per head without RoPE"
    )
    qk_pos_emb_head_dim: int = option(
        64,
        "with --multi-latent-attention: query/key channels per head that RoPE rotates (the "
        "key's are one set shared by all heads)",
    )
    v_head_dim: int = option(128, "with --multi-latent-attention: value channels per head")
    rope_type: str | None = option(
        None,
        "the RoPE of multi-latent attention: yarn (its default; --rotary-scaling-factor 1 "
        "leaves plain RoPE) or rope; other attention takes only rope (its RoPE is "
        "--position-embedding-type's)",
        choices=["rope", "yarn"],
    )

    @property
    def latent_query_head_dim(self) -> int:
        """A query's (and key's) channels per head: the plain ones and the rotated ones."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def latent_rope_type(self) -> str:
        return self.rope_type or "yarn"

    def latent_projections(self) -> list[tuple[int, int, bool]]:
        """(input size, output size, split over TP) of each linear of a multi-latent attention
        layer, in forward order: the down projections are replicated, the up and output
        projections split with the heads (the planner and the FLOP count read these)."""
        h, n = self.hidden_size, self.num_attention_heads
        query = n * self.latent_query_head_dim
        if self.q_lora_rank is None:
            out = [(h, query, True)]
        else:
            out = [(h, self.q_lora_rank, False), (self.q_lora_rank, query, True)]
        out += [
            (h, self.kv_lora_rank + self.qk_pos_emb_head_dim, False),
            (self.kv_lora_rank, n * (self.qk_head_dim + self.v_head_dim), True),
            (n * self.v_head_dim, h, True),
        ]
        return out

    def latent_softmax_scale(self) -> float:
        """megatron-core's MLA softmax scale: mscale(factor, mscale_all_dim)^2 / sqrt(q dim),
        with YaRN's mscale(f, m) = 0.1 m ln f + 1 for f > 1 (else 1)."""
        factor = self.rotary_scaling_factor
        mscale = 1.0 if factor <= 1 else 0.1 * self.mscale_all_dim * math.log(factor) + 1.0
        return mscale * mscale / math.sqrt(self.latent_query_head_dim)

    def latent_rope_scaling(self) -> dict | None:
        """The YaRN of multi-latent attention as rope_parameters would hold it (None: plain
        RoPE), read by engine/model/rope.py and the exports."""
        from engine.config.rope_scaling import YarnScaling

        if self.latent_rope_type != "yarn":
            return None
        yarn = YarnScaling(
            float(self.rotary_scaling_factor),
            self.yarn_original_max_position_embeddings or 4096,
            self.yarn_beta_fast or 32.0,
            self.yarn_beta_slow or 1.0,
            self.mscale,
            self.mscale_all_dim,
            self.yarn_correction_range_round_to_int,
        )
        return {"rope_type": "yarn", "factor": float(self.rotary_scaling_factor)} | (
            yarn.parameters()
        )

    def validate_latent_attention(self, tp: int) -> None:
        """ConfigError naming the flag for what multi-latent attention cannot take."""
        if not self.multi_latent_attention:
            if self.rope_type not in (None, "rope"):
                raise ConfigError(
                    f"--rope-type {self.rope_type} is multi-latent attention's; other "
                    "attention takes YaRN as --position-embedding-type yarn (as Megatron-LM "
                    "refuses it)"
                )
            if "mla_up_proj" in (self.recompute_modules or ()):
                raise ConfigError(
                    "--recompute-modules mla_up_proj needs --multi-latent-attention (as in "
                    "Megatron-LM)"
                )
            return
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ConfigError("--q-lora-rank must be at least 1 (or left out: no query latent)")
        if self.qk_pos_emb_head_dim % 2:
            raise ConfigError(
                f"--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim}: RoPE turns channel pairs; "
                "give an even number"
            )
        refused = (
            (self.group_query_attention, "--group-query-attention", "MLA shares no key groups"),
            (self.position_embedding_type != "rope", "--position-embedding-type "
             f"{self.position_embedding_type}", "MLA rotates its own channels; give rope "
             "(with --rope-type yarn|rope)"),
            (self.use_rope_scaling or self.rotary_seq_len_interpolation_factor
             or self.rope_scaling_type, "--use-rope-scaling, --rope-scaling-type and "
             "--rotary-seq-len-interpolation-factor", "MLA scales RoPE by YaRN: --rope-type "
             "yarn with --rotary-scaling-factor"),
            (self.rotary_percent != 1.0, f"--rotary-percent {self.rotary_percent}",
             "MLA rotates all of its --qk-pos-emb-head-dim channels"),
            (self.rotary_interleaved, "--rotary-interleaved", "megatron-core refuses it with "
             "MLA, whose RoPE pairs channels its own way"),
            (self.qk_layernorm_across_heads, "--qk-layernorm-across-heads",
             "MLA's --qk-layernorm normalises its two latents"),
            (self.has_sinks, f"--softmax-type {self.softmax_type}",
             "attention sinks with MLA are not built here"),
            (self.window_size is not None, "--window-size", "sliding windows with MLA are "
             "not built here"),
            (self.add_qkv_bias, "--add-qkv-bias", "MLA's projections have no biases"),
        )  # fmt: skip
        for wrong, flag, why in refused:
            if wrong:
                raise ConfigError(f"{flag} with --multi-latent-attention: {why}")
        if self.rotary_scaling_factor < 1:
            raise ConfigError(
                f"--rotary-scaling-factor {self.rotary_scaling_factor} must be at least 1"
            )
