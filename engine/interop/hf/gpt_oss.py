"""How a gpt-oss model maps onto Hugging Face's GptOssForCausalLM.

gpt-oss: every layer a mixture of experts behind a router with a bias (softmax over the top-k
logits); experts with biases and a clamped gated unit, quick GELU on the gate and the up half
plus one (--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value swiglu_limit);
attention with biases on every projection, a learned sink per head (--softmax-type learnable)
and a sliding window on the layers `layer_types` says (--window-size "(W-1, 0)" with
--window-attn-skip-freq as a 0/1 list); YaRN RoPE; RMSNorm; untied embeddings.

transformers keeps each layer's experts in four fused tensors (engine/interop/hf/hf_tensor.py:
gate_up_proj [E, h, 2f] with the gate's and up's columns interleaved, its bias, down_proj
[E, f, h], its bias); ours are per expert, as for the other families. An option HF has no
equivalent for is a ConfigError naming it.
"""

from __future__ import annotations

from engine.config.model import ModelConfig
from engine.errors import ConfigError
from engine.interop.hf.decoder_shape import decoder_shape
from engine.interop.hf.hf_tensor import HFTensor
from engine.interop.hf.rope import rope_parameters

GPT_OSS = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
QUICK_GELU_ALPHA = 1.702  # megatron-core's quick_gelu gain, transformers' swiglu_alpha


def check_gpt_oss(cfg: ModelConfig) -> None:
    """ConfigError naming the first option of `cfg` GptOssForCausalLM cannot express."""
    every_layer_moe = cfg.is_moe and all(cfg.moe_layer_pattern(cfg.num_layers))
    top_k_softmax = cfg.moe_router_score_function == "softmax" and not cfg.moe_router_pre_softmax
    learnable = cfg.softmax_type == "learnable"
    checks = [
        (every_layer_moe, "dense layers (every gpt-oss layer is an MoE)"),
        (cfg.quick_geglu, "an MLP other than --quick-geglu"),
        (cfg.glu_linear_offset == 1.0, f"--glu-linear-offset {cfg.glu_linear_offset} (gpt-oss: 1)"),
        (cfg.activation_func_clamp_value is not None, "an unclamped gated unit"),
        (cfg.add_bias_linear, "--disable-bias-linear (gpt-oss has biases)"),
        (learnable, f"--softmax-type {cfg.softmax_type} (gpt-oss: learnable)"),
        (cfg.normalization == "RMSNorm", "LayerNorm"),
        (cfg.uses_rope, "learned positions"),
        (not cfg.qk_layernorm, "--qk-layernorm"),
        (cfg.untie_embeddings_and_output_weights, "tied embeddings"),
        (not cfg.moe_shared_expert_intermediate_size, "shared experts"),
        (top_k_softmax, "a router other than softmax over the top-k logits"),
        (not cfg.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias"),
        (cfg.moe_router_group_topk is None, "group-limited routing"),
        (cfg.moe_router_topk_scaling_factor in (None, 1.0), "--moe-router-topk-scaling-factor"),
        (cfg.moe_expert_capacity_factor is None, "--moe-expert-capacity-factor"),
        (cfg.rotary_percent == 1.0 and not cfg.rotary_interleaved, "partial or interleaved RoPE"),
    ]  # fmt: skip
    for ok, what in checks:
        if not ok:
            raise ConfigError(f"{what} has no equivalent in {ARCHITECTURE}; cannot export")


def gpt_oss_tensors(cfg: ModelConfig) -> list[HFTensor]:
    out = [HFTensor("model.embed_tokens.weight", ("embedding.word_embeddings.weight",))]
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        attn, mlp = f"{ours}.self_attention", f"{ours}.mlp"
        out.append(HFTensor(f"{hf}.input_layernorm.weight", (f"{ours}.input_layernorm.weight",)))
        for name in "qkv":
            for kind in ("weight", "bias"):
                source = (f"{attn}.linear_qkv.{kind}.{name}",)
                out.append(HFTensor(f"{hf}.self_attn.{name}_proj.{kind}", source))
        out += [
            HFTensor(f"{hf}.self_attn.o_proj.weight", (f"{attn}.linear_proj.weight",)),
            HFTensor(f"{hf}.self_attn.o_proj.bias", (f"{attn}.linear_proj.bias",)),
            HFTensor(f"{hf}.self_attn.sinks", (f"{attn}.core_attention.softmax_offset",)),
            HFTensor(
                f"{hf}.post_attention_layernorm.weight", (f"{ours}.pre_mlp_layernorm.weight",)
            ),
            HFTensor(f"{hf}.mlp.router.weight", (f"{mlp}.router.weight",)),
            HFTensor(f"{hf}.mlp.router.bias", (f"{mlp}.router.bias",)),
        ]
        experts = [f"{mlp}.experts.local_experts.{e}" for e in range(cfg.num_experts)]
        fused = f"{hf}.mlp.experts"
        for kind, layout in (("weight", "experts_gate_up"), ("bias", "experts_gate_up_bias")):
            parts = tuple(
                f"{e}.linear_fc1.{kind}.{half}" for e in experts for half in ("gate", "up")
            )
            name = f"{fused}.gate_up_proj" + ("" if kind == "weight" else "_bias")
            out.append(HFTensor(name, parts, layout=layout))
        out += [
            HFTensor(
                f"{fused}.down_proj",
                tuple(f"{e}.linear_fc2.weight" for e in experts),
                layout="experts_down",
            ),
            HFTensor(
                f"{fused}.down_proj_bias",
                tuple(f"{e}.linear_fc2.bias" for e in experts),
                layout="experts_stack",
            ),
        ]
    out += [
        HFTensor("model.norm.weight", ("final_layernorm.weight",)),
        HFTensor("lm_head.weight", ("output_layer.weight",)),
    ]
    return out


def _layer_types(cfg: ModelConfig) -> list[str]:
    windowed = [cfg.window_of(layer) is not None for layer in range(cfg.num_layers)]
    return ["sliding_attention" if w else "full_attention" for w in windowed]


def gpt_oss_config(cfg: ModelConfig) -> dict:
    """config.json's fields for GptOssForCausalLM (besides the common ones)."""
    window = cfg.attention_window
    return {
        "model_type": GPT_OSS,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.expert_ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_dim": cfg.head_dim,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_router_topk,
        "router_aux_loss_coef": cfg.aux_loss_coeff("aux_loss") or 0.0,
        "swiglu_alpha": QUICK_GELU_ALPHA,
        "swiglu_limit": cfg.activation_func_clamp_value,
        # itself and `window` back; without a window no layer slides, but transformers builds
        # the sliding mask anyway and needs a size: the longest sequence
        "sliding_window": cfg.max_positions if window is None else window + 1,
        "layer_types": _layer_types(cfg),
        "attention_bias": True,
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.norm_epsilon,
        "rope_parameters": rope_parameters(cfg),
        "tie_word_embeddings": False,
        "attention_dropout": cfg.attention_dropout,
        "initializer_range": cfg.init_method_std,
        "hidden_act": "silu",
    }


def gpt_oss_options(hf: dict) -> dict:
    """Our ModelConfig options for a gpt_oss config.json."""
    alpha = hf.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if abs(alpha - QUICK_GELU_ALPHA) > 1e-9:
        raise ConfigError(f"gpt_oss swiglu_alpha {alpha} is not supported (1.702, quick GELU's)")
    if not hf.get("attention_bias", True):
        raise ConfigError("gpt_oss without attention_bias is not supported")
    layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    window = hf.get("sliding_window")
    windowed = [int(kind == "sliding_attention") for kind in kinds]
    return decoder_shape(hf, 1e-5) | dict(
        add_bias_linear=True,
        quick_geglu=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)),
        softmax_type="learnable",
        window_size=f"({window - 1}, 0)" if window and any(windowed) else None,
        window_attn_skip_freq=f"({windowed})" if window and any(windowed) else None,
        untie_embeddings_and_output_weights=True,
        hidden_dropout=0.0,
        attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02),
        num_experts=hf["num_local_experts"],
        moe_ffn_hidden_size=hf["intermediate_size"],
        moe_router_topk=hf.get("num_experts_per_tok", 4),
        moe_aux_loss_coeff=[float(hf.get("router_aux_loss_coef", 0.0))],
    )
