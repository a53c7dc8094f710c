"""Hugging Face's DeepseekV3ForCausalLM in and out: a random model made by transformers
(multi-latent attention with and without the query latent, YaRN with its softmax-scale
correction, dense first layers then experts behind the sigmoid router with its correction bias,
group-limited routing and shared experts) comes back bit-identical after import and export,
gives transformers' logits imported in one process and under TP2 x EP2 x PP2, and loads back
into transformers from our export with the same logits."""

from __future__ import annotations

import os

import pytest
import torch

from engine.checkpoint.files import iteration_dir, read_meta
from engine.checkpoint.load import load_model_weights
from engine.config.model import ModelConfig
from engine.interop.hf.import_hf import import_from_hf
from tests.distributed import rel_err
from tests.hf_checks import (
    imported_under_tp2_ep2_pp2,
    round_trip,
    trained_matches_transformers,
)
from tests.requirements import require

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))


def _random_deepseek_v3(folder, q_lora_rank):
    transformers = require("transformers")
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=500, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 16,
        },
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # every tensor away from its initial value (norms, correction bias)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.add_(torch.randn(8) * 0.1)
    model.save_pretrained(folder)
    return model.eval()


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_deepseek_v3_round_trip_and_logits(tmp_path, q_lora_rank):
    hf = _random_deepseek_v3(tmp_path / "hf", q_lora_rank)
    cfg, before, after = round_trip(hf, tmp_path, TOKENS, "deepseek_v3")
    assert cfg.multi_latent_attention and cfg.q_lora_rank == q_lora_rank
    assert cfg.moe_layer_pattern(4) == [0, 1, 1, 1] and cfg.moe_router_num_groups == 2
    for key in ("first_k_dense_replace", "n_group", "topk_group", "q_lora_rank", "kv_lora_rank"):
        assert after[key] == before[key], key


def test_deepseek_v3_imported_under_tp2_ep2_pp2(tmp_path):
    imported_under_tp2_ep2_pp2(_random_deepseek_v3(tmp_path / "hf", 24), tmp_path, TOKENS)


DEEPSEEK_V3_FLAGS = {
    "--multi-latent-attention": True, "--q-lora-rank": "24", "--kv-lora-rank": "16",
    "--qk-head-dim": "16", "--qk-pos-emb-head-dim": "8", "--v-head-dim": "12",
    "--qk-layernorm": True, "--position-embedding-type": "rope", "--rotary-scaling-factor": "4",
    "--mscale-all-dim": "1", "--yarn-original-max-position-embeddings": "16",
    "--num-experts": "4", "--moe-layer-freq": "([0]*1+[1]*3)", "--moe-ffn-hidden-size": "24",
    "--moe-shared-expert-intermediate-size": "24", "--moe-router-score-function": "sigmoid",
    "--moe-router-enable-expert-bias": True, "--moe-router-topk": "2",
    "--moe-router-topk-scaling-factor": "2.5", "--moe-router-num-groups": "2",
    "--moe-router-group-topk": "1", "--swiglu": True, "--disable-bias-linear": True,
    "--normalization": "RMSNorm", "--norm-epsilon": "1e-6",
    "--untie-embeddings-and-output-weights": True,
    "--attention-dropout": "0.0", "--hidden-dropout": "0.0",
    "--expert-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
    "--recompute-granularity": "selective", "--recompute-modules": ["mla_up_proj", "core_attn"],
    "--mtp-num-layers": "1", "--train-iters": "6", "--lr-warmup-iters": "1",
}  # fmt: skip


def test_a_deepseek_v3_trained_here_generates_the_same_in_transformers(
    dataset_prefix, tokenizer_model, tmp_path
):
    """A tiny DeepSeek-V3 trained 6 steps under EP2 x PP2 (its up projections recomputed,
    one multi-token-prediction depth) exports as DeepseekV3ForCausalLM with the engine's
    logits and greedy tokens; its MTP layer is written as DeepSeek-V3's checkpoints keep it
    (model.layers.<L>) and comes back from the export unchanged."""
    ours, cfg = trained_matches_transformers(
        dataset_prefix, tokenizer_model, tmp_path, DEEPSEEK_V3_FLAGS, "DeepseekV3ForCausalLM"
    )
    from engine.model import BuildContext, GPTModel

    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "again"))
    again = iteration_dir(str(tmp_path / "again"), 0)
    assert ModelConfig(**read_meta(again)["model"]).mtp_num_layers == 1
    back = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(again, back)
    mtp = {n: p for n, p in back.named_parameters() if n.startswith("mtp.")}
    assert len(mtp) > 10 and "mtp.layers.0.eh_proj.weight" in mtp
    trained = dict(ours.named_parameters())
    for name, param in back.named_parameters():
        assert torch.equal(param, trained[name]), name


QUANTIZED = r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)"


def test_block_scaled_fp8_weights_import_dequantized(tmp_path):
    """DeepSeek-V3's published FP8 weights (E4M3 in 16 x 16 blocks here, each with its
    weight_scale_inv; quantization_config fp8): imported as the same model saved with
    transformers' own dequantization (computed in fp32, rounded to bfloat16), bit for bit, and
    to transformers' logits."""
    import json
    import re

    from safetensors.torch import load_file, save_file

    from engine.model import BuildContext, GPTModel

    fp8 = require("transformers.integrations.finegrained_fp8")
    transformers = require("transformers")
    _random_deepseek_v3(tmp_path / "hf", 24)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    plain, quantized = dict(tensors), dict(tensors)
    for name, weight in tensors.items():
        if not re.search(QUANTIZED + r"\.weight$", name):
            continue
        rows, cols = weight.shape  # (some not multiples of 16: partial blocks at the edges)
        padded = torch.nn.functional.pad(weight.float(), (0, -cols % 16, 0, -rows % 16))
        blocks = padded.reshape(padded.shape[0] // 16, 16, padded.shape[1] // 16, 16)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # E4M3's largest value
        spread = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)[:rows, :cols]
        values = (weight.float() / spread).to(torch.float8_e4m3fn)
        quantized[name], quantized[name + "_scale_inv"] = values, scale
        back = fp8._dequantize_fp8_weight(values, scale, [16, 16], torch.float32)
        plain[name] = back.to(torch.bfloat16).to(weight.dtype)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for name, content, extra in (("plain", plain, {}), ("fp8", quantized, {
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}
    })):  # fmt: skip
        (tmp_path / name).mkdir()
        save_file(content, tmp_path / name / "model.safetensors")
        (tmp_path / name / "config.json").write_text(json.dumps(config | extra))
        import_from_hf(str(tmp_path / name), str(tmp_path / f"ours-{name}"))
    models = []
    for name in ("ours-plain", "ours-fp8"):
        path = iteration_dir(str(tmp_path / name), 0)
        cfg = ModelConfig(**read_meta(path)["model"])
        models.append(GPTModel(cfg, BuildContext(cfg)))
        load_model_weights(path, models[-1].eval())
    reference = dict(models[0].named_parameters())
    for name, param in models[1].named_parameters():
        assert torch.equal(param, reference[name]), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
    with torch.no_grad():
        ours = models[1].full_logits(models[1](tokens=TOKENS))
        assert rel_err(ours, hf(TOKENS).logits) < 1e-5


def test_export_details_transformers_needs():
    """Norms stored centred on zero are exported as 1 + weight, the MTP depth's too; a
    sigmoid router's single expert is not normalised (norm_topk_prob false), and the other
    pairing is refused on import."""
    from engine.errors import ConfigError
    from engine.interop.hf.architectures import hf_tensors
    from engine.interop.hf.deepseek_v3 import deepseek_v3_config, deepseek_v3_options

    cfg = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
        multi_latent_attention=True, position_embedding_type="rope", qk_layernorm=True,
        normalization="RMSNorm", apply_layernorm_1p=True, swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, num_experts=4, moe_layer_freq="[0,1]",
        moe_router_topk=1, moe_router_score_function="sigmoid", mtp_num_layers=1,
        moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=16,
        moe_ffn_hidden_size=16, norm_epsilon=1e-6,
    )  # fmt: skip
    shifted = {t.name for t in hf_tensors(cfg, "deepseek_v3") if t.shift == 1.0}
    assert {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight"} <= shifted
    assert "model.layers.0.self_attn.kv_a_layernorm.weight" in shifted
    hf = deepseek_v3_config(cfg)
    assert hf["norm_topk_prob"] is False and hf["num_experts_per_tok"] == 1
    with pytest.raises(ConfigError, match="norm_topk_prob true and one expert per token"):
        deepseek_v3_options(hf | {"norm_topk_prob": True, "vocab_size": 64})
