"""How our model maps onto Hugging Face's LlamaForCausalLM and GPT2LMHeadModel.

A model is exported as Llama when it is Llama-style (RoPE, RMSNorm, SwiGLU, no biases) and as
GPT-2 when it is GPT-2-style (learned positions, LayerNorm, GELU, biases, tied embeddings,
multi-head attention). Any option the target has no equivalent for is a ConfigError naming
it: the exported model is never silently different from the trained one.

Each HF tensor is our logical tensors (checkpoint keys without "model/") stacked along dim 0,
transposed for GPT-2's Conv1D layers, which store weights as [in, out].
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.config import ModelConfig
from engine.errors import ConfigError

LLAMA, GPT2 = "llama", "gpt2"
ARCHITECTURES = {LLAMA: "LlamaForCausalLM", GPT2: "GPT2LMHeadModel"}


@dataclass(frozen=True)
class HFTensor:
    name: str
    parts: tuple[str, ...]
    transpose: bool = False
    shift: float = 0.0  # HF value = ours + shift (norm weights stored centred on zero)


def style_of(cfg: ModelConfig) -> str:
    """'llama' or 'gpt2', or ConfigError naming the first option neither can express."""
    llama_like = cfg.position_embedding_type == "rope"
    target = ARCHITECTURES[LLAMA if llama_like else GPT2]
    if cfg.qk_layernorm:
        raise ConfigError(f"--qk-layernorm has no equivalent in {target}; cannot export")
    if llama_like:
        checks = [
            (cfg.normalization == "RMSNorm", "--normalization LayerNorm (Llama uses RMSNorm)"),
            (cfg.swiglu, "a GELU MLP without --swiglu (Llama uses SwiGLU)"),
            (not cfg.add_bias_linear, "linear biases (Llama has none: use --disable-bias-linear)"),
            (not cfg.openai_gelu, "--openai-gelu"),
            (
                cfg.rotary_percent == 1.0,
                f"--rotary-percent {cfg.rotary_percent} (Llama rotates every channel of a head)",
            ),
        ]
    else:
        checks = [
            (cfg.normalization == "LayerNorm", "--normalization RMSNorm (GPT-2 uses LayerNorm)"),
            (not cfg.swiglu, "--swiglu (GPT-2 has a GELU MLP)"),
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
    return LLAMA if llama_like else GPT2


def hf_tensors(cfg: ModelConfig, style: str) -> list[HFTensor]:
    """Every tensor of the HF model and where it comes from, in a stable order. With
    --apply-layernorm-1p the norm weights are 1 + ours (HF norms multiply by the weight)."""
    tensors = _hf_tensors(cfg, style)
    if not cfg.apply_layernorm_1p:
        return tensors
    return [
        replace(t, shift=1.0) if t.parts[0].endswith("layernorm.weight") else t for t in tensors
    ]


def _hf_tensors(cfg: ModelConfig, style: str) -> list[HFTensor]:
    out = []
    if style == LLAMA:
        out.append(HFTensor("model.embed_tokens.weight", ("embedding.word_embeddings.weight",)))
        for i in range(cfg.num_layers):
            ours, hf = f"layers.{i}", f"model.layers.{i}"
            attn, mlp = f"{ours}.self_attention", f"{ours}.mlp"
            out += [
                HFTensor(f"{hf}.input_layernorm.weight", (f"{ours}.input_layernorm.weight",)),
                HFTensor(f"{hf}.self_attn.q_proj.weight", (f"{attn}.linear_qkv.weight.q",)),
                HFTensor(f"{hf}.self_attn.k_proj.weight", (f"{attn}.linear_qkv.weight.k",)),
                HFTensor(f"{hf}.self_attn.v_proj.weight", (f"{attn}.linear_qkv.weight.v",)),
                HFTensor(f"{hf}.self_attn.o_proj.weight", (f"{attn}.linear_proj.weight",)),
                HFTensor(
                    f"{hf}.post_attention_layernorm.weight", (f"{ours}.pre_mlp_layernorm.weight",)
                ),
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
    if style == LLAMA:
        return common | {
            "model_type": "llama",
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.query_groups,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_positions,
            "rms_norm_eps": cfg.norm_epsilon,
            "rope_parameters": {"rope_theta": float(cfg.rotary_base), "rope_type": "default"},
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": cfg.attention_dropout,
            "initializer_range": cfg.init_method_std,
        }
    return common | {
        "model_type": "gpt2",
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_attention_heads,
        "n_inner": cfg.ffn_size,
        "n_positions": cfg.max_positions,
        "activation_function": "gelu_new" if cfg.openai_gelu else "gelu",
        "layer_norm_epsilon": cfg.norm_epsilon,
        "resid_pdrop": cfg.hidden_dropout,
        "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": cfg.attention_dropout,
        "initializer_range": cfg.init_method_std,
        "tie_word_embeddings": True,
    }


def model_config_from_hf(hf: dict) -> tuple[ModelConfig, str]:
    """Our ModelConfig for a Hugging Face config.json (Llama or GPT-2), and the style."""
    kind = hf.get("model_type")
    if kind == "llama":
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(
                f"rope_type {rope['rope_type']!r} (RoPE scaling) is not supported; only the "
                "default rotary embedding"
            )
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ConfigError("Llama checkpoints with attention_bias/mlp_bias are not supported")
        heads = hf["num_attention_heads"]
        cfg = ModelConfig(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            num_attention_heads=heads,
            group_query_attention=True,
            num_query_groups=hf.get("num_key_value_heads", heads),
            ffn_hidden_size=hf["intermediate_size"],
            kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
            seq_length=hf.get("max_position_embeddings", 2048),
            max_position_embeddings=hf.get("max_position_embeddings"),
            vocab_size=hf["vocab_size"],
            position_embedding_type="rope",
            rotary_base=int(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            normalization="RMSNorm",
            norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            swiglu=True,
            add_bias_linear=False,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            hidden_dropout=0.0,
            attention_dropout=hf.get("attention_dropout", 0.0),
            init_method_std=hf.get("initializer_range", 0.02),
        )
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"Llama hidden_act {hf['hidden_act']!r} is not supported (silu)")
        return cfg, LLAMA
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
            hidden_dropout=hf.get("resid_pdrop", 0.1),
            attention_dropout=hf.get("attn_pdrop", 0.1),
            init_method_std=hf.get("initializer_range", 0.02),
        )
        return cfg, GPT2
    raise ConfigError(
        f"model_type {kind!r} is not supported; import LlamaForCausalLM or GPT2LMHeadModel"
    )
