"""How a mixture of experts maps onto Hugging Face's MixtralForCausalLM, Qwen2MoeForCausalLM,
Qwen3MoeForCausalLM and OlmoeForCausalLM (their attention, norms and embeddings are the Llama
family's: engine/interop/hf/architectures.py).

- Mixtral: every layer an MoE, the top-k probabilities renormalised (our softmax over the top-k
  logits, the default), no shared experts, optionally a sliding window.
- Qwen2-MoE: shared experts behind a sigmoid gate (--moe-shared-expert-intermediate-size with
  --moe-shared-expert-gate), biases on q, k and v or none (qkv_bias), dense layers where
  `mlp_only_layers` / `decoder_sparse_step` say (our --moe-layer-freq), the top-k normalised or
  not (norm_topk_prob: without, our --moe-router-pre-softmax).
- Qwen3-MoE: queries and keys normalised per head (--qk-layernorm), no shared experts, dense
  layers and norm_topk_prob as Qwen2-MoE.
- OLMoE: queries and keys normalised over all heads at once (--qk-layernorm
  --qk-layernorm-across-heads), every layer an MoE, no shared experts, norm_topk_prob as
  Qwen2-MoE; its clip_qkv (clamping q, k and v) has no equivalent and is refused.

The experts are stored as transformers writes them (and as the published checkpoints are):
one tensor per expert and projection (Mixtral's w1 = gate, w3 = up, w2 = down). A router or
dispatch option HF has no equivalent for (a sigmoid or Sinkhorn router, an expert bias, group
routing, a top-k scaling, token dropping) is a ConfigError naming it.
"""

from __future__ import annotations

from engine.config.model import ModelConfig
from engine.errors import ConfigError
from engine.interop.hf.hf_tensor import HFTensor

MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE = "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"
MOE_ARCHITECTURES = {
    MIXTRAL: "MixtralForCausalLM",
    QWEN2_MOE: "Qwen2MoeForCausalLM",
    QWEN3_MOE: "Qwen3MoeForCausalLM",
    OLMOE: "OlmoeForCausalLM",
}


def moe_style_of(cfg: ModelConfig) -> str:
    """The HF family of a mixture of experts, or ConfigError naming what it cannot express."""
    checks = [
        (cfg.moe_router_score_function == "softmax", "--moe-router-score-function sigmoid"),
        (not cfg.uses_sinkhorn, "Sinkhorn routing (--moe-router-load-balancing-type sinkhorn)"),
        (not cfg.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias"),
        (cfg.moe_router_group_topk is None, "group-limited routing (--moe-router-group-topk)"),
        (
            cfg.moe_router_topk_scaling_factor in (None, 1.0),
            "--moe-router-topk-scaling-factor",
        ),
        (
            cfg.moe_expert_capacity_factor is None,
            "--moe-expert-capacity-factor (HF's experts drop no tokens)",
        ),
        (not cfg.moe_apply_probs_on_input, "--moe-apply-probs-on-input"),
    ]
    shared = bool(cfg.moe_shared_expert_intermediate_size)
    if cfg.qk_layernorm_across_heads:
        style = OLMOE
        checks += [
            (not shared, "shared experts with --qk-layernorm-across-heads (OLMoE has none)"),
            (not cfg.add_qkv_bias, "--add-qkv-bias (OLMoE has no attention biases)"),
            (all(cfg.moe_layer_pattern(cfg.num_layers)), "dense layers between the MoE layers"),
        ]
    elif cfg.qk_layernorm:
        style = QWEN3_MOE
        checks.append((not shared, "shared experts with --qk-layernorm (Qwen3-MoE has none)"))
        checks.append(
            (not cfg.add_qkv_bias, "--add-qkv-bias with --qk-layernorm (Qwen3-MoE has none)")
        )
    elif shared:
        style = QWEN2_MOE
        checks.append(
            (cfg.moe_shared_expert_gate, "shared experts without --moe-shared-expert-gate")
        )
    else:
        style = MIXTRAL
        checks += [
            (all(cfg.moe_layer_pattern(cfg.num_layers)), "dense layers between the MoE layers"),
            (not cfg.add_qkv_bias, "--add-qkv-bias without shared experts"),
            (
                not cfg.moe_router_pre_softmax,
                "--moe-router-pre-softmax (un-normalised top-k) without shared experts",
            ),
        ]
    checks.append(
        (
            style == MIXTRAL or cfg.attention_window is None,
            f"--window-size in a {MOE_ARCHITECTURES[style]}",
        )
    )
    for ok, what in checks:
        if not ok:
            target = MOE_ARCHITECTURES[style]
            raise ConfigError(f"{what} has no equivalent in {target}; cannot export this model")
    return style


def moe_layer_tensors(cfg: ModelConfig, style: str, layer: int) -> list[HFTensor]:
    """The HF tensors of MoE layer `layer`'s MLP: router, experts, shared experts."""
    ours = f"layers.{layer}.mlp"
    block = f"model.layers.{layer}." + ("block_sparse_moe" if style == MIXTRAL else "mlp")
    out = [HFTensor(f"{block}.gate.weight", (f"{ours}.router.weight",))]
    names = ("w1", "w3", "w2") if style == MIXTRAL else ("gate_proj", "up_proj", "down_proj")
    for e in range(cfg.num_experts):
        expert = f"{ours}.experts.local_experts.{e}"
        out += _mlp(f"{block}.experts.{e}", expert, names)
    if cfg.moe_shared_expert_intermediate_size:
        shared = f"{ours}.shared_experts"
        out += _mlp(f"{block}.shared_expert", shared, ("gate_proj", "up_proj", "down_proj"))
        out.append(HFTensor(f"{block}.shared_expert_gate.weight", (f"{shared}.gate_weight",)))
    return out


def _mlp(hf: str, ours: str, names: tuple[str, str, str]) -> list[HFTensor]:
    gate, up, down = names
    return [
        HFTensor(f"{hf}.{gate}.weight", (f"{ours}.linear_fc1.weight.gate",)),
        HFTensor(f"{hf}.{up}.weight", (f"{ours}.linear_fc1.weight.up",)),
        HFTensor(f"{hf}.{down}.weight", (f"{ours}.linear_fc2.weight",)),
    ]


def moe_config_fields(cfg: ModelConfig, style: str) -> dict:
    """config.json's MoE fields (and what differs from the Llama family's)."""
    coefficient = cfg.aux_loss_coeff("aux_loss") or 0.0
    if style == MIXTRAL:
        window = cfg.attention_window
        return {
            "intermediate_size": cfg.expert_ffn_size,
            "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.moe_router_topk,
            "router_aux_loss_coef": coefficient,
            "router_jitter_noise": 0.0,
            "sliding_window": None if window is None else window + 1,
        }
    if style == OLMOE:
        return {
            "intermediate_size": cfg.expert_ffn_size,
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.moe_router_topk,
            "norm_topk_prob": not cfg.moe_router_pre_softmax,
            "router_aux_loss_coef": coefficient,
            "output_router_logits": False,
            "attention_bias": False,
            "clip_qkv": None,
        }
    pattern = cfg.moe_layer_pattern(cfg.num_layers)
    out = {
        "moe_intermediate_size": cfg.expert_ffn_size,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_router_topk,
        "norm_topk_prob": not cfg.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, is_moe in enumerate(pattern) if not is_moe],
        "router_aux_loss_coef": coefficient,
        "use_sliding_window": False,
    }
    if style == QWEN2_MOE:
        return out | {
            "shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
            "qkv_bias": cfg.add_qkv_bias,
        }
    return out | {"attention_bias": False}


def moe_options_from_hf(hf: dict, kind: str) -> dict:
    """Our ModelConfig options for an HF MoE config.json (beyond the Llama family's)."""
    if kind == MIXTRAL:
        if hf.get("router_jitter_noise"):
            raise ConfigError(
                "Mixtral's router_jitter_noise (it jitters the experts' input too) has no "
                "equivalent here; only 0.0 is supported"
            )
        experts, ffn = hf["num_local_experts"], hf["intermediate_size"]
        window = hf.get("sliding_window")
        options = {"ffn_hidden_size": ffn, "moe_ffn_hidden_size": ffn, "moe_layer_freq": "1"}
        options |= {"window_size": f"({window - 1}, 0)" if window else None}
    elif kind == OLMOE:
        if hf.get("clip_qkv") is not None:
            raise ConfigError(
                f"OLMoE's clip_qkv {hf['clip_qkv']} (q, k and v clamped) has no equivalent "
                "here; only null is supported"
            )
        if hf.get("attention_bias"):
            raise ConfigError("OLMoE checkpoints with attention_bias are not supported")
        experts, ffn = hf["num_experts"], hf["intermediate_size"]
        options = {"ffn_hidden_size": ffn, "moe_ffn_hidden_size": ffn, "moe_layer_freq": "1"}
        options |= {"moe_router_pre_softmax": not hf.get("norm_topk_prob", False)}
        options |= {"qk_layernorm_across_heads": True}
    else:
        # (published Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts)
        experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
        layers = hf["num_hidden_layers"]
        dense = set(hf.get("mlp_only_layers") or [])
        step = hf.get("decoder_sparse_step", 1)
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
        if not any(pattern):
            raise ConfigError(f"{kind}: mlp_only_layers and decoder_sparse_step leave no MoE layer")
        options = {
            "ffn_hidden_size": hf["intermediate_size"],
            "moe_ffn_hidden_size": hf["moe_intermediate_size"],
            "moe_layer_freq": "1" if all(pattern) else str(pattern),
            "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
        }
        shared = hf.get("shared_expert_intermediate_size") if kind == QWEN2_MOE else None
        if shared:
            options |= {
                "moe_shared_expert_intermediate_size": shared,
                "moe_shared_expert_gate": True,
            }
    coefficient = float(hf.get("router_aux_loss_coef") or 0.0)
    return options | {
        "num_experts": experts,
        "moe_router_topk": hf["num_experts_per_tok"],
        "moe_aux_loss_coeff": [coefficient],
    }
