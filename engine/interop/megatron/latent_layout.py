"""megatron-core's DeepSeek-V3 tensors in a `torch_dist` checkpoint: multi-latent attention's
and multi-token prediction's, and the Megatron-LM arguments that describe them.

Multi-latent attention (per layer, like every layer tensor: layer-stacked or per-layer keys):
`self_attention.linear_q_proj` (or `linear_q_down_proj` and `linear_q_up_proj`),
`linear_kv_down_proj`, `linear_kv_up_proj`, `linear_proj`; the latent norms under
TransformerEngine's fused names (`linear_q_up_proj.layer_norm_weight`,
`linear_kv_up_proj.layer_norm_weight`, written) or the local layers' own (`q_layernorm.weight`,
`kv_layernorm.weight`, read too); the input norm stays `input_layernorm.weight` (not fused into
a down projection). Multi-token prediction: `mtp.layers.<k>.` `enorm`, `hnorm`, `eh_proj`,
`final_layernorm` and `transformer_layer.<a layer's names>`, keyed per depth (no layer axis;
a mixture of experts' experts stacked along the first).

Megatron-LM's MLA has no flags for YaRN's original length (4096), beta_fast (32), beta_slow (1)
or the rounding of its correction range (on): a model with other values is refused on export.
"""

from __future__ import annotations

from engine.config.model import ModelConfig
from engine.errors import ConfigError

ATTENTION = "decoder.layers.self_attention"
MTP_NORMS = ("enorm", "hnorm", "final_layernorm")


def latent_attention_sources(cfg: ModelConfig) -> dict[str, list[tuple[str, str]]]:
    """Our tensor (within a layer) -> [(megatron-core layer-stacked key, part)] for
    multi-latent attention, first present wins (the first is written)."""
    attn = ATTENTION
    kinds = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
    out = {
        f"input_layernorm.{kind}": [(f"decoder.layers.input_layernorm.{kind}", "")]
        for kind in kinds
    }
    linears = ["linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
    linears += ["linear_q_proj"] if cfg.q_lora_rank is None else [
        "linear_q_down_proj", "linear_q_up_proj"
    ]  # fmt: skip
    for name in linears:
        out[f"self_attention.{name}.weight"] = [(f"{attn}.{name}.weight", "")]
    if cfg.add_bias_linear:
        out["self_attention.linear_proj.bias"] = [(f"{attn}.linear_proj.bias", "")]
    if cfg.qk_layernorm:
        norms = [("kv_layernorm", "linear_kv_up_proj")]
        if cfg.q_lora_rank is not None:
            norms.append(("q_layernorm", "linear_q_up_proj"))
        for (norm, fused), kind in ((n, k) for n in norms for k in kinds):
            out[f"self_attention.{norm}.{kind}"] = [
                (f"{attn}.{fused}.layer_norm_{kind}", ""),
                (f"{attn}.{norm}.{kind}", ""),
            ]
    return out


def latent_extra_state_modules(cfg: ModelConfig) -> list[str]:
    """The attention modules megatron-core saves an `_extra_state` for with MLA."""
    names = ["linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", "core_attention"]
    names += ["linear_q_proj"] if cfg.q_lora_rank is None else [
        "linear_q_down_proj", "linear_q_up_proj"
    ]  # fmt: skip
    return [f"self_attention.{name}" for name in names]


def mtp_depth_keys(cfg: ModelConfig, depth: int) -> dict[str, str]:
    """Our tensor -> megatron-core's key, for a depth's own tensors (not its layer's)."""
    prefix = f"mtp.layers.{depth}"
    kinds = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
    names = [f"{prefix}.{norm}.{kind}" for norm in MTP_NORMS for kind in kinds]
    return {name: name for name in [*names, f"{prefix}.eh_proj.weight"]}


def mtp_layer_key(stacked: str, depth: int) -> str:
    """A layer's megatron-core key (layer-stacked form) as depth `depth`'s layer keys it."""
    return stacked.replace("decoder.layers.", f"mtp.layers.{depth}.transformer_layer.", 1)


def latent_options_from_args(get) -> dict:
    """Our MLA and MTP fields from Megatron-LM's saved arguments (its defaults where unset)."""
    out = {}
    if get("multi_latent_attention"):
        out = {
            "multi_latent_attention": True,
            "q_lora_rank": get("q_lora_rank"),
            "kv_lora_rank": get("kv_lora_rank") or 32,
            "qk_head_dim": get("qk_head_dim") or 128,
            "qk_pos_emb_head_dim": get("qk_pos_emb_head_dim") or 64,
            "v_head_dim": get("v_head_dim") or 128,
            "rope_type": get("rope_type"),
            "rotary_scaling_factor": float(get("rotary_scaling_factor") or 1.0),
            "mscale": float(get("mscale") if get("mscale") is not None else 1.0),
            "mscale_all_dim": float(get("mscale_all_dim") or 0.0),
        }
    if get("mtp_num_layers"):
        factor = get("mtp_loss_scaling_factor")
        out |= {
            "mtp_num_layers": int(get("mtp_num_layers")),
            "mtp_loss_scaling_factor": 0.1 if factor is None else float(factor),
        }
    return out


def latent_args(cfg: ModelConfig) -> dict:
    """Megatron-LM's MLA and MTP arguments for our model; ConfigError for a YaRN Megatron-LM
    cannot express (module docstring)."""
    out = {"multi_latent_attention": cfg.multi_latent_attention}
    if cfg.multi_latent_attention:
        scaling = cfg.latent_rope_scaling()
        if scaling is not None:
            fixed = (4096, 32.0, 1.0, True)
            given = (
                scaling["original_max_position_embeddings"], scaling["beta_fast"],
                scaling["beta_slow"], scaling["truncate"],
            )  # fmt: skip
            if given != fixed:
                raise ConfigError(
                    f"multi-latent attention's YaRN with original length, beta_fast, beta_slow "
                    f"and rounding {given}: Megatron-LM fixes them at {fixed} (it has no flags "
                    "for them), so it would not be the same model; export to Hugging Face instead"
                )
        out |= {
            "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_head_dim": cfg.qk_head_dim,
            "qk_pos_emb_head_dim": cfg.qk_pos_emb_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "rope_type": cfg.rope_type,
            "rotary_scaling_factor": cfg.rotary_scaling_factor,
            "mscale": cfg.mscale,
            "mscale_all_dim": cfg.mscale_all_dim,
        }
    if cfg.mtp_depths:
        out |= {
            "mtp_num_layers": cfg.mtp_num_layers,
            "mtp_loss_scaling_factor": cfg.mtp_loss_scaling_factor,
        }
    return out
