"""Hugging Face's GptOssForCausalLM in and out (its MXFP4 experts too): a random model made by
transformers (sinks, alternating sliding-window and full layers, biased attention, router and
experts, the clamped gated unit, YaRN) comes back bit-identical after import and export, gives
transformers' logits imported in one process and under TP2 x EP2 x PP2, and loads back into
transformers from our export with the same logits; a gpt-oss trained here under EP2 x PP2
gives the same logits and greedy tokens in transformers."""

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


def _random_gpt_oss(folder, windows: bool = True, intermediate: int = 48, experts=None):
    """experts(model): sets the experts' weights before saving (default: perturbed)."""
    transformers = require("transformers")
    torch.manual_seed(0)
    kinds = None if windows else ["full_attention"] * 4  # (default: alternating from sliding)
    config = transformers.GptOssConfig(
        layer_types=kinds,
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=intermediate, vocab_size=500, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16,
        },
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # every parameter away from its initial value (biases, sinks, norms)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        if experts is not None:
            experts(model)
    model.save_pretrained(folder)
    return model.eval()


@pytest.mark.parametrize("windows", [True, False])
def test_gpt_oss_round_trip_and_logits(tmp_path, windows):
    hf = _random_gpt_oss(tmp_path / "hf", windows)
    cfg, before, after = round_trip(hf, tmp_path, TOKENS, "gpt_oss")
    assert cfg.softmax_type == "learnable" and cfg.quick_geglu
    assert cfg.window_of(0) == (7 if windows else None) and cfg.window_of(1) is None
    for key in ("layer_types", "sliding_window", "swiglu_limit", "num_local_experts"):
        if key != "sliding_window" or windows:  # (no layer slides: any size, unused)
            assert after[key] == before[key], key


GPT_OSS_FLAGS = {
    "--num-experts": "4", "--moe-router-topk": "2", "--moe-ffn-hidden-size": "48",
    "--quick-geglu": True, "--glu-linear-offset": "1", "--activation-func-clamp-value": "7",
    "--softmax-type": "learnable", "--window-size": "(7, 0)", "--window-attn-skip-freq": "2",
    "--position-embedding-type": "yarn", "--rotary-scaling-factor": "4",
    "--yarn-original-max-position-embeddings": "16", "--normalization": "RMSNorm",
    "--untie-embeddings-and-output-weights": True, "--group-query-attention": True,
    "--num-query-groups": "2", "--attention-dropout": "0.0", "--hidden-dropout": "0.0",
    "--expert-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
    "--train-iters": "6", "--lr-warmup-iters": "1",
}  # fmt: skip


def test_a_gpt_oss_trained_here_generates_the_same_in_transformers(
    dataset_prefix, tokenizer_model, tmp_path
):
    """A tiny gpt-oss trained 6 steps under EP2 x PP2 exports as GptOssForCausalLM with the
    engine's logits and greedy tokens."""
    trained_matches_transformers(
        dataset_prefix, tokenizer_model, tmp_path, GPT_OSS_FLAGS, "GptOssForCausalLM"
    )


def test_other_quantized_weights_are_refused_in_one_line():
    """Quantized weights other than gpt-oss's MXFP4 experts and block-scaled FP8 ones are a
    one-line error."""
    from engine.errors import ConfigError
    from engine.interop.hf.architectures import model_config_from_hf

    quantized = {"model_type": "llama", "quantization_config": {"quant_method": "awq"}}
    with pytest.raises(ConfigError, match="llama checkpoint with awq weights"):
        model_config_from_hf(quantized)


def test_gpt_oss_imported_under_tp2_ep2_pp2(tmp_path):
    """Attention heads and sinks split over TP2 (with SP), the experts (with their biases)
    whole on each of EP2's ranks (ETP 1), the layers over PP2."""
    imported_under_tp2_ep2_pp2(_random_gpt_oss(tmp_path / "hf"), tmp_path, TOKENS)


def test_mxfp4_experts_import_as_transformers_dequantizes_them(tmp_path):
    """OpenAI's MXFP4 experts (name_blocks, name_scales; quantization_config mxfp4) import as
    the weights transformers' own dequantization makes of them: a folder with random MXFP4
    experts gives our checkpoint the tensors of the same model saved dequantized by
    transformers, bit for bit, and transformers' logits."""
    import json

    from safetensors.torch import load_file, save_file

    mxfp4 = require("transformers.integrations.mxfp4")
    gen = torch.Generator().manual_seed(5)
    packed = {}

    def random_mxfp4(model):
        for i, layer in enumerate(model.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                weight = getattr(layer.mlp.experts, name)  # [E, in, out]
                e, cols, rows = weight.shape
                blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen)
                scales = torch.randint(118, 128, (e, rows, cols // 32), generator=gen)
                blocks, scales = blocks.to(torch.uint8), scales.to(torch.uint8)
                value = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
                weight.copy_(value.to(weight.dtype))
                packed[f"model.layers.{i}.mlp.experts.{name}"] = (blocks, scales)

    hf = _random_gpt_oss(tmp_path / "hf", intermediate=64, experts=random_mxfp4)
    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    for name, (blocks, scales) in packed.items():
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, quantized / "model.safetensors")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (quantized / "config.json").write_text(json.dumps(config))
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "plain"))
    import_from_hf(str(quantized), str(tmp_path / "ours"))

    from engine.model import BuildContext, GPTModel

    models = []
    for name in ("plain", "ours"):
        path = iteration_dir(str(tmp_path / name), 0)
        cfg = ModelConfig(**read_meta(path)["model"])
        model = GPTModel(cfg, BuildContext(cfg))
        load_model_weights(path, model.eval())
        models.append(model)
    plain, ours = (dict(m.named_parameters()) for m in models)
    for name, param in ours.items():
        assert torch.equal(param, plain[name]), name
    with torch.no_grad():
        logits = models[1].full_logits(models[1](tokens=TOKENS))
        assert rel_err(logits, hf(TOKENS).logits) < 1e-5
