"""How our model maps onto Hugging Face's LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM and GPT2LMHeadModel, and with mixtures of experts onto
MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM and OlmoeForCausalLM
(engine/interop/hf/moe.py) and GptOssForCausalLM (engine/interop/hf/gpt_oss.py).

The Llama family (RoPE, RMSNorm, SwiGLU, no biases on the MLP and the output projection)
shares its tensor names; a model is exported as Qwen2 when it has biases on q, k and v only
(--add-qkv-bias --disable-bias-linear), as Qwen3 when it normalises queries and keys per head
(--qk-layernorm), as Mistral when its attention has a sliding window (--window-size), else
as Llama; RoPE scaling (--use-rope-scaling: "llama3";
--rotary-seq-len-interpolation-factor: "linear") goes to `rope_parameters`. GPT-2-style models
(learned positions, LayerNorm, GELU, biases, tied embeddings, multi-head attention) go to
GPT-2. Any option the target has no equivalent for is a ConfigError naming it: the exported
model is never silently different from the trained one.

Each HF tensor is our logical tensors (checkpoint keys without "model/") stacked along dim 0,
transposed for GPT-2's Conv1D layers, which store weights as [in, out].
"""

from __future__ import annotations

from dataclasses import replace

from engine.config.model import ModelConfig
from engine.errors import ConfigError
from engine.interop.hf.decoder_shape import decoder_shape
from engine.interop.hf.deepseek_v3 import ARCHITECTURE as DEEPSEEK_V3_ARCHITECTURE
from engine.interop.hf.deepseek_v3 import (
    DEEPSEEK_V3,
    check_deepseek_v3,
    deepseek_v3_config,
    deepseek_v3_options,
    deepseek_v3_tensors,
)
from engine.interop.hf.fp8 import QUANT_METHOD as FP8
from engine.interop.hf.gpt_oss import ARCHITECTURE as GPT_OSS_ARCHITECTURE
from engine.interop.hf.gpt_oss import (
    GPT_OSS,
    check_gpt_oss,
    gpt_oss_config,
    gpt_oss_options,
    gpt_oss_tensors,
)
from engine.interop.hf.hf_tensor import HFTensor
from engine.interop.hf.moe import (
    MOE_ARCHITECTURES,
    OLMOE,
    QWEN2_MOE,
    QWEN3_MOE,
    moe_config_fields,
    moe_layer_tensors,
    moe_options_from_hf,
    moe_style_of,
)
from engine.interop.hf.mxfp4 import QUANT_METHOD as MXFP4
from engine.interop.hf.rope import rope_parameters

LLAMA, MISTRAL, QWEN2, QWEN3, GPT2 = "llama", "mistral", "qwen2", "qwen3", "gpt2"
ARCHITECTURES = {
    LLAMA: "LlamaForCausalLM",
    MISTRAL: "MistralForCausalLM",
    QWEN2: "Qwen2ForCausalLM",
    QWEN3: "Qwen3ForCausalLM",
    GPT2: "GPT2LMHeadModel",
    GPT_OSS: GPT_OSS_ARCHITECTURE,
    DEEPSEEK_V3: DEEPSEEK_V3_ARCHITECTURE,
} | MOE_ARCHITECTURES
LLAMA_FAMILY = (LLAMA, MISTRAL, QWEN2, QWEN3, *MOE_ARCHITECTURES)  # (engine/interop/hf/moe.py)


def refused_attention(cfg: ModelConfig) -> str | None:
    """The flag of gpt-oss's a model uses (sinks, windows on some layers only, its gated
    MLP), which of Hugging Face's families only GptOssForCausalLM expresses, or None."""
    if cfg.quick_geglu or cfg.glu_linear_offset or cfg.activation_func_clamp_value is not None:
        return "--quick-geglu / --glu-linear-offset / --activation-func-clamp-value"
    if cfg.has_sinks:
        return f"--softmax-type {cfg.softmax_type}"
    if cfg.window_attn_skip_freq is not None and cfg.attention_window is not None:
        return f"--window-attn-skip-freq {cfg.window_attn_skip_freq}"
    return None


def _llama_family_member(cfg: ModelConfig) -> str:
    if cfg.qk_layernorm_across_heads:
        raise ConfigError(
            "--qk-layernorm-across-heads has no equivalent in a dense Llama-family model "
            "(OLMoE's, a mixture of experts, only); cannot export"
        )
    if cfg.qk_layernorm and cfg.add_qkv_bias:
        raise ConfigError(
            "--qk-layernorm with --add-qkv-bias has no equivalent in Qwen3ForCausalLM (its "
            "attention_bias also puts a bias on the output projection); cannot export"
        )
    if cfg.attention_window is not None:
        if cfg.qk_layernorm or cfg.add_qkv_bias:
            raise ConfigError(
                "--window-size with --qk-layernorm or --add-qkv-bias has no equivalent here "
                "(sliding windows are exported as MistralForCausalLM only); cannot export"
            )
        return MISTRAL
    if cfg.qk_layernorm:
        return QWEN3
    return QWEN2 if cfg.add_qkv_bias else LLAMA


def style_of(cfg: ModelConfig) -> str:
    """'llama', 'qwen2', 'qwen3' or 'gpt2', or ConfigError naming the first option the
    target cannot express."""
    if cfg.multi_latent_attention:
        check_deepseek_v3(cfg)
        return DEEPSEEK_V3
    if refused_attention(cfg):  # sinks, per-layer windows, gpt-oss's MLP
        check_gpt_oss(cfg)
        return GPT_OSS
    llama_like = cfg.uses_rope
    if cfg.is_moe and not llama_like:
        raise ConfigError(
            "a mixture of experts without RoPE has no equivalent in Mixtral, Qwen2-MoE or "
            "Qwen3-MoE; cannot export this model"
        )
    if cfg.is_moe:
        style = moe_style_of(cfg)
    else:
        style = _llama_family_member(cfg) if llama_like else GPT2
    target = ARCHITECTURES[style]
    if llama_like:
        checks = [
            (cfg.normalization == "RMSNorm", "--normalization LayerNorm (Llama uses RMSNorm)"),
            (cfg.swiglu, "a GELU MLP without --swiglu (Llama uses SwiGLU)"),
            (not cfg.add_bias_linear, "linear biases (Llama has none: use --disable-bias-linear)"),
            (not cfg.openai_gelu, "--openai-gelu"),
            (not cfg.squared_relu, "--squared-relu"),
            (not cfg.rotary_interleaved, "--rotary-interleaved (Llama rotates halves)"),
            (
                cfg.rotary_percent == 1.0,
                f"--rotary-percent {cfg.rotary_percent} (Llama rotates every channel of a head)",
            ),
            (
                not (cfg.use_rope_scaling and cfg.rotary_seq_len_interpolation_factor),
                "--use-rope-scaling with --rotary-seq-len-interpolation-factor (one rope_type)",
            ),
        ]
    else:
        checks = [
            (not cfg.qk_layernorm, "--qk-layernorm"),
            (cfg.attention_window is None, "--window-size"),
            (not cfg.add_qkv_bias or cfg.add_bias_linear, "--add-qkv-bias alone"),
            (cfg.normalization == "LayerNorm", "--normalization RMSNorm (GPT-2 uses LayerNorm)"),
            (not cfg.swiglu, "--swiglu (GPT-2 has a GELU MLP)"),
            (not cfg.squared_relu, "--squared-relu (GPT-2 has a GELU MLP)"),
            (cfg.add_bias_linear, "--disable-bias-linear (GPT-2 has biases)"),
            (
                not cfg.untie_embeddings_and_output_weights,
                "--untie-embeddings-and-output-weights (GPT2LMHeadModel ties them)",
            ),
            (
                cfg.query_groups == cfg.num_attention_heads,
                "--num-query-groups (GPT-2 has no grouped-query attention)",
            ),
            (
                cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size,
                "--kv-channels other than hidden / heads",
            ),
        ]
    for ok, what in checks:
        if not ok:
            raise ConfigError(f"{what} has no equivalent in {target}; cannot export this model")
    return style


def hf_tensors(cfg: ModelConfig, style: str) -> list[HFTensor]:
    """Every tensor of the HF model and where it comes from, in a stable order. With
    --apply-layernorm-1p the norm weights are 1 + ours (HF norms multiply by the weight)."""
    tensors = _hf_tensors(cfg, style)
    if not cfg.apply_layernorm_1p:
        return tensors
    return [replace(t, shift=1.0) if t.parts[0].endswith("norm.weight") else t for t in tensors]


def _hf_tensors(cfg: ModelConfig, style: str) -> list[HFTensor]:
    if style == GPT_OSS:
        return gpt_oss_tensors(cfg)
    if style == DEEPSEEK_V3:
        return deepseek_v3_tensors(cfg)
    out = []
    if style in LLAMA_FAMILY:
        moe_layers = cfg.moe_layer_pattern(cfg.num_layers)
        out.append(HFTensor("model.embed_tokens.weight", ("embedding.word_embeddings.weight",)))
        for i in range(cfg.num_layers):
            ours, hf = f"layers.{i}", f"model.layers.{i}"
            attn, mlp = f"{ours}.self_attention", f"{ours}.mlp"
            out.append(
                HFTensor(f"{hf}.input_layernorm.weight", (f"{ours}.input_layernorm.weight",))
            )
            for name in "qkv":
                out.append(
                    HFTensor(
                        f"{hf}.self_attn.{name}_proj.weight", (f"{attn}.linear_qkv.weight.{name}",)
                    )
                )
                if style == QWEN2 or (style == QWEN2_MOE and cfg.add_qkv_bias):
                    out.append(
                        HFTensor(
                            f"{hf}.self_attn.{name}_proj.bias", (f"{attn}.linear_qkv.bias.{name}",)
                        )
                    )
            if style in (QWEN3, QWEN3_MOE, OLMOE):
                out += [
                    HFTensor(f"{hf}.self_attn.q_norm.weight", (f"{attn}.q_layernorm.weight",)),
                    HFTensor(f"{hf}.self_attn.k_norm.weight", (f"{attn}.k_layernorm.weight",)),
                ]
            out += [
                HFTensor(f"{hf}.self_attn.o_proj.weight", (f"{attn}.linear_proj.weight",)),
                HFTensor(
                    f"{hf}.post_attention_layernorm.weight", (f"{ours}.pre_mlp_layernorm.weight",)
                ),
            ]
            if moe_layers[i]:
                out += moe_layer_tensors(cfg, style, i)
                continue
            out += [
                HFTensor(f"{hf}.mlp.gate_proj.weight", (f"{mlp}.linear_fc1.weight.gate",)),
                HFTensor(f"{hf}.mlp.up_proj.weight", (f"{mlp}.linear_fc1.weight.up",)),
                HFTensor(f"{hf}.mlp.down_proj.weight", (f"{mlp}.linear_fc2.weight",)),
            ]
        out.append(HFTensor("model.norm.weight", ("final_layernorm.weight",)))
        if cfg.untie_embeddings_and_output_weights:
            out.append(HFTensor("lm_head.weight", ("output_layer.weight",)))
        return out
    out += [
        HFTensor("transformer.wte.weight", ("embedding.word_embeddings.weight",)),
        HFTensor("transformer.wpe.weight", ("embedding.position_embeddings.weight",)),
    ]
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}", f"transformer.h.{i}"
        attn, mlp = f"{ours}.self_attention", f"{ours}.mlp"
        qkv = f"{attn}.linear_qkv"
        out += [
            HFTensor(f"{hf}.ln_1.weight", (f"{ours}.input_layernorm.weight",)),
            HFTensor(f"{hf}.ln_1.bias", (f"{ours}.input_layernorm.bias",)),
            HFTensor(
                f"{hf}.attn.c_attn.weight",
                (f"{qkv}.weight.q", f"{qkv}.weight.k", f"{qkv}.weight.v"),
                transpose=True,
            ),
            HFTensor(f"{hf}.attn.c_attn.bias", (f"{qkv}.bias.q", f"{qkv}.bias.k", f"{qkv}.bias.v")),
            HFTensor(f"{hf}.attn.c_proj.weight", (f"{attn}.linear_proj.weight",), transpose=True),
            HFTensor(f"{hf}.attn.c_proj.bias", (f"{attn}.linear_proj.bias",)),
            HFTensor(f"{hf}.ln_2.weight", (f"{ours}.pre_mlp_layernorm.weight",)),
            HFTensor(f"{hf}.ln_2.bias", (f"{ours}.pre_mlp_layernorm.bias",)),
            HFTensor(f"{hf}.mlp.c_fc.weight", (f"{mlp}.linear_fc1.weight",), transpose=True),
            HFTensor(f"{hf}.mlp.c_fc.bias", (f"{mlp}.linear_fc1.bias",)),
            HFTensor(f"{hf}.mlp.c_proj.weight", (f"{mlp}.linear_fc2.weight",), transpose=True),
            HFTensor(f"{hf}.mlp.c_proj.bias", (f"{mlp}.linear_fc2.bias",)),
        ]
    out += [
        HFTensor("transformer.ln_f.weight", ("final_layernorm.weight",)),
        HFTensor("transformer.ln_f.bias", ("final_layernorm.bias",)),
    ]
    return out


def hf_config_dict(cfg: ModelConfig, style: str, special_ids: dict, dtype: str) -> dict:
    """The config.json of the exported model."""
    common = {
        "architectures": [ARCHITECTURES[style]],
        "vocab_size": cfg.vocab_size,
        "bos_token_id": special_ids.get("bos"),
        "eos_token_id": special_ids.get("eos"),
        "pad_token_id": special_ids.get("pad"),
        "dtype": dtype,
    }
    if style == GPT_OSS:
        return common | gpt_oss_config(cfg)
    if style == DEEPSEEK_V3:
        return common | deepseek_v3_config(cfg)
    if style in LLAMA_FAMILY:
        out = common | {
            "model_type": style,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.query_groups,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_positions,
            "rms_norm_eps": cfg.norm_epsilon,
            "rope_parameters": rope_parameters(cfg),
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "attention_dropout": cfg.attention_dropout,
            "initializer_range": cfg.init_method_std,
        }
        if style == LLAMA:
            out |= {"attention_bias": False, "mlp_bias": False}
        elif style == MISTRAL:
            out |= {"sliding_window": cfg.attention_window + 1}  # itself and `window` before
        elif style == QWEN3:
            out |= {"attention_bias": False, "use_sliding_window": False}
        elif style in MOE_ARCHITECTURES:
            out |= moe_config_fields(cfg, style)
        else:
            out |= {"use_sliding_window": False}
        return out
    return common | {
        "model_type": "gpt2",
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_attention_heads,
        "n_inner": cfg.ffn_size,
        "n_positions": cfg.max_positions,
        "activation_function": "gelu_new" if cfg.gelu_tanh else "gelu",
        "layer_norm_epsilon": cfg.norm_epsilon,
        "resid_pdrop": cfg.hidden_dropout,
        "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": cfg.attention_dropout,
        "initializer_range": cfg.init_method_std,
        "tie_word_embeddings": True,
    }


def model_config_from_hf(hf: dict) -> tuple[ModelConfig, str]:
    """Our ModelConfig for a Hugging Face config.json (the Llama family, its MoE members, or
    GPT-2), and the style."""
    kind = hf.get("model_type")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "quantized")
        # gpt-oss's MXFP4 experts and block-scaled FP8 weights are read dequantized
        # (engine/interop/hf/mxfp4.py, fp8.py)
        if not ((kind == GPT_OSS and method == MXFP4) or method == FP8):
            raise ConfigError(
                f"{kind} checkpoint with {method} weights (quantization_config): only "
                "unquantized weights, block-scaled FP8 ones and gpt-oss's MXFP4 experts are "
                "imported; save a dequantized copy with transformers first"
            )
    if kind == GPT_OSS:
        return ModelConfig(**gpt_oss_options(hf)), GPT_OSS
    if kind == DEEPSEEK_V3:
        return ModelConfig(**deepseek_v3_options(hf)), DEEPSEEK_V3
    if kind in LLAMA_FAMILY:
        if kind == LLAMA and (hf.get("attention_bias") or hf.get("mlp_bias")):
            raise ConfigError("Llama checkpoints with attention_bias/mlp_bias are not supported")
        if kind in (QWEN3, QWEN3_MOE) and hf.get("attention_bias"):
            raise ConfigError(f"{kind} checkpoints with attention_bias are not supported")
        if kind != LLAMA and hf.get("use_sliding_window"):
            raise ConfigError(
                f"{kind} with use_sliding_window (sliding-window attention) is not supported"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{kind} hidden_act {hf['hidden_act']!r} is not supported (silu)")
        window = hf.get("sliding_window") if kind == MISTRAL else None
        moe = moe_options_from_hf(hf, kind) if kind in MOE_ARCHITECTURES else {}
        qkv_bias = kind == QWEN2 or (kind == QWEN2_MOE and hf.get("qkv_bias", True))
        options = decoder_shape(hf, 1e-6) | dict(
            ffn_hidden_size=hf["intermediate_size"],
            swiglu=True,
            add_bias_linear=False,
            add_qkv_bias=qkv_bias,
            qk_layernorm=kind in (QWEN3, QWEN3_MOE, OLMOE),
            window_size=f"({window - 1}, 0)" if window else None,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            hidden_dropout=0.0,
            attention_dropout=hf.get("attention_dropout", 0.0),
            init_method_std=hf.get("initializer_range", 0.02),
        )
        return ModelConfig(**options | moe), kind
    if kind == "gpt2":
        activation = hf.get("activation_function", "gelu_new")
        if activation not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"GPT-2 activation_function {activation!r} is not supported")
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
            raise ConfigError(
                "GPT-2 checkpoints with scale_attn_by_inverse_layer_idx or "
                "reorder_and_upcast_attn are not supported"
            )
        hidden = hf["n_embd"]
        cfg = ModelConfig(
            num_layers=hf["n_layer"],
            hidden_size=hidden,
            num_attention_heads=hf["n_head"],
            ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
            seq_length=hf["n_positions"],
            max_position_embeddings=hf["n_positions"],
            vocab_size=hf["vocab_size"],
            position_embedding_type="learned_absolute",
            normalization="LayerNorm",
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            openai_gelu=activation != "gelu",
            bias_gelu_fusion=activation != "gelu",
            hidden_dropout=hf.get("resid_pdrop", 0.1),
            attention_dropout=hf.get("attn_pdrop", 0.1),
            init_method_std=hf.get("initializer_range", 0.02),
        )
        return cfg, GPT2
    raise ConfigError(
        f"model_type {kind!r} is not supported; import LlamaForCausalLM, MistralForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, "
        "Qwen3MoeForCausalLM, OlmoeForCausalLM, GptOssForCausalLM, DeepseekV3ForCausalLM or "
        "GPT2LMHeadModel"
    )
