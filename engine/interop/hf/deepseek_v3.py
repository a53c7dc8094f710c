"""How a DeepSeek-V3 model maps onto Hugging Face's DeepseekV3ForCausalLM.

DeepSeek-V3: multi-latent attention (engine/model/latent_attention.py; its two latent norms are
--qk-layernorm, its RoPE pairs channels as transformers' rope_interleave does, YaRN with the
softmax-scale correction), the first `first_k_dense_replace` layers dense (--moe-layer-freq
'([0]*k+[1]*n)') and the rest mixtures of experts behind a sigmoid router with an expert bias
(e_score_correction_bias, our --moe-router-enable-expert-bias), group-limited top-k
(n_group, topk_group) and a scaling factor, plus shared experts; RMSNorm; untied embeddings.

transformers scores a group by the sum of its two best experts; megatron-core by the sum of its
top k / group-topk: the two agree only where that ratio is 2 (DeepSeek-V3's 8 / 4), and other
ratios are refused. The experts are stored one tensor per expert and projection, as transformers
writes them. Multi-token-prediction layers (--mtp-num-layers) are written after the decoder's as
DeepSeek-V3's own checkpoints keep them (model.layers.<L+k>: embed_tokens, enorm, hnorm,
eh_proj, shared_head.norm and .head, and a decoder layer) and read back where present;
transformers' model itself leaves them out (it ignores those tensors).
"""

from __future__ import annotations

from dataclasses import replace

from engine.config.model import ModelConfig
from engine.errors import ConfigError
from engine.interop.hf.decoder_shape import decoder_shape
from engine.interop.hf.hf_tensor import HFTensor
from engine.interop.hf.rope import rope_parameters

DEEPSEEK_V3 = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
# transformers builds the two latent norms with their own epsilon, whatever rms_norm_eps says;
# ours (as megatron-core's) take --norm-epsilon
LATENT_NORM_EPSILON = 1e-6


def _dense_layers(cfg: ModelConfig) -> int | None:
    """k where the first k layers are dense and the rest MoE (None: another pattern)."""
    pattern = cfg.moe_layer_pattern(cfg.num_layers)
    k = pattern.index(1) if 1 in pattern else cfg.num_layers
    return k if all(pattern[k:]) and not any(pattern[:k]) else None


def check_deepseek_v3(cfg: ModelConfig) -> None:
    """ConfigError naming the first option of `cfg` DeepseekV3ForCausalLM cannot express."""
    shared, expert = cfg.moe_shared_expert_intermediate_size, cfg.moe_ffn_hidden_size
    groups = cfg.moe_router_num_groups
    scale_corrected = cfg.latent_softmax_scale() * cfg.latent_query_head_dim**0.5 != 1.0
    checks = [
        (cfg.multi_latent_attention, "attention other than --multi-latent-attention"),
        (cfg.qk_layernorm, "latents without --qk-layernorm (DeepSeek-V3 normalises both)"),
        (cfg.is_moe, "a dense model (DeepSeek-V3's layers after the first k are MoE)"),
        (not cfg.is_moe or _dense_layers(cfg) is not None,
         f"--moe-layer-freq {cfg.moe_layer_freq} (DeepSeek-V3: k dense layers, then MoE)"),
        (cfg.swiglu, "an MLP other than --swiglu"),
        (not cfg.add_bias_linear, "linear biases"),
        (cfg.normalization == "RMSNorm", "LayerNorm"),
        (cfg.norm_epsilon == LATENT_NORM_EPSILON,
         f"--norm-epsilon {cfg.norm_epsilon} (its latent norms keep {LATENT_NORM_EPSILON})"),
        (cfg.untie_embeddings_and_output_weights, "tied embeddings"),
        (cfg.latent_rope_type == "yarn" or not scale_corrected,
         "--rope-type rope with a YaRN softmax-scale correction"),
        (cfg.moe_router_score_function == "sigmoid", "a router other than sigmoid"),
        (cfg.moe_router_enable_expert_bias,
         "a router without --moe-router-enable-expert-bias (e_score_correction_bias)"),
        (bool(shared) and not cfg.moe_shared_expert_gate and shared % (expert or 1) == 0,
         "shared experts other than a whole number of ungated experts"),
        (groups is None or cfg.moe_router_topk // cfg.moe_router_group_topk == 2,
         "group-limited routing with --moe-router-topk / --moe-router-group-topk other than 2"),
        (groups is not None or cfg.num_experts >= 2, "a single expert"),
        (cfg.moe_expert_capacity_factor is None, "--moe-expert-capacity-factor"),
    ]  # fmt: skip
    for ok, what in checks:
        if not ok:
            raise ConfigError(f"{what} has no equivalent in {ARCHITECTURE}; cannot export")


def _mlp(hf: str, ours: str) -> list[HFTensor]:
    return [
        HFTensor(f"{hf}.gate_proj.weight", (f"{ours}.linear_fc1.weight.gate",)),
        HFTensor(f"{hf}.up_proj.weight", (f"{ours}.linear_fc1.weight.up",)),
        HFTensor(f"{hf}.down_proj.weight", (f"{ours}.linear_fc2.weight",)),
    ]


def _layer_tensors(cfg: ModelConfig, ours: str, hf: str, moe: bool) -> list[HFTensor]:
    """One decoder layer's tensors: ours under `ours`, HF's under `hf`."""
    attn, hf_attn = f"{ours}.self_attention", f"{hf}.self_attn"
    out = [HFTensor(f"{hf}.input_layernorm.weight", (f"{ours}.input_layernorm.weight",))]
    if cfg.q_lora_rank is None:
        out.append(HFTensor(f"{hf_attn}.q_proj.weight", (f"{attn}.linear_q_proj.weight",)))
    else:
        out += [
            HFTensor(f"{hf_attn}.q_a_proj.weight", (f"{attn}.linear_q_down_proj.weight",)),
            HFTensor(f"{hf_attn}.q_a_layernorm.weight", (f"{attn}.q_layernorm.weight",)),
            HFTensor(f"{hf_attn}.q_b_proj.weight", (f"{attn}.linear_q_up_proj.weight",)),
        ]
    out += [
        HFTensor(f"{hf_attn}.kv_a_proj_with_mqa.weight", (f"{attn}.linear_kv_down_proj.weight",)),
        HFTensor(f"{hf_attn}.kv_a_layernorm.weight", (f"{attn}.kv_layernorm.weight",)),
        HFTensor(f"{hf_attn}.kv_b_proj.weight", (f"{attn}.linear_kv_up_proj.weight",)),
        HFTensor(f"{hf_attn}.o_proj.weight", (f"{attn}.linear_proj.weight",)),
        HFTensor(f"{hf}.post_attention_layernorm.weight", (f"{ours}.pre_mlp_layernorm.weight",)),
    ]
    mlp, hf_mlp = f"{ours}.mlp", f"{hf}.mlp"
    if not moe:
        return out + _mlp(hf_mlp, mlp)
    out += [
        HFTensor(f"{hf_mlp}.gate.weight", (f"{mlp}.router.weight",)),
        HFTensor(f"{hf_mlp}.gate.e_score_correction_bias", (f"{mlp}.router.expert_bias",)),
    ]
    for e in range(cfg.num_experts):
        out += _mlp(f"{hf_mlp}.experts.{e}", f"{mlp}.experts.local_experts.{e}")
    return out + _mlp(f"{hf_mlp}.shared_experts", f"{mlp}.shared_experts")


def _mtp_tensors(cfg: ModelConfig, depth: int) -> list[HFTensor]:
    """Multi-token-prediction depth `depth` as DeepSeek-V3's checkpoints keep it: a layer after
    the decoder's with its own copies of the embedding and output layer (written, not read)."""
    ours, hf = f"mtp.layers.{depth}", f"model.layers.{cfg.num_layers + depth}"
    moe = bool(cfg.moe_layer_pattern(cfg.num_layers)[-1])  # built as the decoder's last
    copies = [
        HFTensor(f"{hf}.embed_tokens.weight", ("embedding.word_embeddings.weight",), copy=True),
        HFTensor(f"{hf}.shared_head.head.weight", ("output_layer.weight",), copy=True),
    ]
    return copies + [
        HFTensor(f"{hf}.enorm.weight", (f"{ours}.enorm.weight",)),
        HFTensor(f"{hf}.hnorm.weight", (f"{ours}.hnorm.weight",)),
        HFTensor(f"{hf}.eh_proj.weight", (f"{ours}.eh_proj.weight",)),
        HFTensor(f"{hf}.shared_head.norm.weight", (f"{ours}.final_layernorm.weight",)),
        *_layer_tensors(cfg, f"{ours}.transformer_layer", hf, moe),
    ]


def deepseek_v3_tensors(cfg: ModelConfig) -> list[HFTensor]:
    out = [HFTensor("model.embed_tokens.weight", ("embedding.word_embeddings.weight",))]
    moe_layers = cfg.moe_layer_pattern(cfg.num_layers)
    for i in range(cfg.num_layers):
        out += _layer_tensors(cfg, f"layers.{i}", f"model.layers.{i}", bool(moe_layers[i]))
    for depth in range(cfg.mtp_depths):
        out += _mtp_tensors(cfg, depth)
    out += [
        HFTensor("model.norm.weight", ("final_layernorm.weight",)),
        HFTensor("lm_head.weight", ("output_layer.weight",)),
    ]
    return out


def with_mtp_layers(cfg: ModelConfig, hf: dict, names) -> ModelConfig:
    """cfg with the multi-token-prediction depths config.json names (num_nextn_predict_layers)
    where the weights hold them (`names`: the tensors there; transformers itself keeps
    none)."""
    depths = int(hf.get("num_nextn_predict_layers") or 0)
    present = depths and all(
        f"model.layers.{cfg.num_layers + k}.eh_proj.weight" in names for k in range(depths)
    )
    return replace(cfg, mtp_num_layers=depths) if present else cfg


def deepseek_v3_config(cfg: ModelConfig) -> dict:
    """config.json's fields for DeepseekV3ForCausalLM (besides the common ones)."""
    pattern = cfg.moe_layer_pattern(cfg.num_layers)
    grouped = cfg.moe_router_num_groups is not None
    experts = cfg.num_experts or 0
    return {
        "model_type": DEEPSEEK_V3,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "moe_intermediate_size": cfg.expert_ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "n_shared_experts": cfg.moe_shared_expert_intermediate_size // cfg.expert_ffn_size,
        "n_routed_experts": experts,
        "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_rope_head_dim": cfg.qk_pos_emb_head_dim,
        "qk_nope_head_dim": cfg.qk_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_group": cfg.moe_router_num_groups if grouped else 1,
        "topk_group": cfg.moe_router_group_topk if grouped else 1,
        "num_experts_per_tok": cfg.moe_router_topk,
        "first_k_dense_replace": pattern.index(1),
        "norm_topk_prob": cfg.moe_router_topk > 1,  # (a sigmoid's top-1 is not normalised)
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.norm_epsilon,
        "rope_parameters": rope_parameters(cfg),
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "attention_dropout": cfg.attention_dropout,
        "initializer_range": cfg.init_method_std,
        "num_nextn_predict_layers": cfg.mtp_depths,
    }


def deepseek_v3_options(hf: dict) -> dict:
    """Our ModelConfig options for a deepseek_v3 config.json."""
    refused = [
        (not hf.get("rope_interleave", True), "rope_interleave false (RoPE on halves)"),
        (hf.get("attention_bias"), "attention_bias"),
        (hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r}"),
        (not hf.get("norm_topk_prob", True) and hf.get("num_experts_per_tok", 8) > 1,
         "norm_topk_prob false"),
        (hf.get("norm_topk_prob", True) and hf.get("num_experts_per_tok", 8) == 1,
         "norm_topk_prob true and one expert per token (a sigmoid's top-1 is not normalised)"),
        (not hf.get("n_shared_experts", 1), "no shared experts"),
        (hf.get("rms_norm_eps", LATENT_NORM_EPSILON) != LATENT_NORM_EPSILON,
         f"rms_norm_eps {hf.get('rms_norm_eps')} (its latent norms keep {LATENT_NORM_EPSILON})"),
    ]  # fmt: skip
    for wrong, what in refused:
        if wrong:
            raise ConfigError(f"deepseek_v3 with {what} is not supported")
    layers, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 3)
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    topk = hf.get("num_experts_per_tok", 8)
    if groups > 1 and topk // group_topk != 2:
        raise ConfigError(
            f"deepseek_v3 with num_experts_per_tok {topk} over topk_group {group_topk}: "
            "transformers scores a group by its two best experts, megatron-core by its best "
            "num_experts_per_tok / topk_group; only a ratio of 2 is the same here"
        )
    shape = decoder_shape(hf, 1e-6)
    rope = {"position_embedding_type": "rope"}
    if shape.pop("position_embedding_type") == "yarn":
        rope["rope_type"] = "yarn"
    else:
        rope["rope_type"] = "rope"
    moe_ffn = hf["moe_intermediate_size"]
    return (
        shape
        | rope
        | dict(
            group_query_attention=False,
            num_query_groups=None,
            kv_channels=hf["v_head_dim"],
            multi_latent_attention=True,
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_head_dim=hf["qk_nope_head_dim"],
            qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            qk_layernorm=True,
            ffn_hidden_size=hf["intermediate_size"],
            swiglu=True,
            add_bias_linear=False,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            hidden_dropout=0.0,
            attention_dropout=hf.get("attention_dropout", 0.0),
            init_method_std=hf.get("initializer_range", 0.02),
            num_experts=hf["n_routed_experts"],
            moe_ffn_hidden_size=moe_ffn,
            moe_layer_freq=f"([0]*{dense}+[1]*{layers - dense})",
            moe_router_topk=topk,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=group_topk if groups > 1 else None,
            moe_shared_expert_intermediate_size=moe_ffn * hf.get("n_shared_experts", 1),
        )
    )
