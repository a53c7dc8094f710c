"""Hugging Face's GptOssForCausalLM in and out: a random model made by transformers (sinks,
alternating sliding-window and full layers, biased attention, router and experts, the clamped
gated unit, YaRN) comes back bit-identical after import and export, gives transformers'
logits imported in one process and with its experts over two expert-parallel ranks, and loads
back into transformers from our export with the same logits."""

from __future__ import annotations

import json
import os

import torch

from engine.checkpoint.files import iteration_dir, read_meta
from engine.checkpoint.load import load_model_weights
from engine.config.model import ModelConfig
from engine.interop.hf.export import export_to_hf
from engine.interop.hf.import_hf import import_from_hf
from tests.distributed import rel_err, run_ranks
from tests.requirements import require

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))


def _random_gpt_oss(folder):
    transformers = require("transformers")
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, vocab_size=500, max_position_embeddings=64,
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
    model.save_pretrained(folder)
    return model.eval()


def test_gpt_oss_round_trip_and_logits(tmp_path):
    transformers = require("transformers")
    from safetensors.torch import load_file

    from engine.model import BuildContext, GPTModel

    hf = _random_gpt_oss(tmp_path / "hf")
    summary = import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert summary["architecture"] == "gpt_oss"
    path = iteration_dir(str(tmp_path / "ours"), 0)
    cfg = ModelConfig(**read_meta(path)["model"])
    assert cfg.softmax_type == "learnable" and cfg.quick_geglu and cfg.window_of(0) == 7
    assert cfg.window_of(1) is None
    model = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(path, model.eval())
    with torch.no_grad():
        expected = hf(TOKENS).logits
        ours = model.full_logits(model(tokens=TOKENS))
    assert rel_err(ours, expected) < 1e-5
    export_to_hf(str(tmp_path / "ours"), str(tmp_path / "again"))
    original = load_file(tmp_path / "hf" / "model.safetensors")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert original.keys() == again.keys()
    for key, value in original.items():
        assert torch.equal(value, again[key]), key
    with open(tmp_path / "hf" / "config.json") as f:
        before = json.load(f)
    with open(tmp_path / "again" / "config.json") as f:
        after = json.load(f)
    for key in ("layer_types", "sliding_window", "swiglu_limit", "num_local_experts"):
        assert after[key] == before[key], key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        assert rel_err(reloaded(TOKENS).logits, expected) < 1e-6


def _ep2_logits(rank, world, ckpt, tokens):
    from engine.model.builder import build_model_chunks
    from parallel.state import ParallelState

    state = ParallelState.build(tp=1, ep=2)
    path = iteration_dir(ckpt, 0)
    cfg = ModelConfig(**read_meta(path)["model"])
    (model,) = build_model_chunks(cfg, state)
    load_model_weights(path, model.eval())
    with torch.no_grad():
        return model.full_logits(model(tokens=tokens))


def test_gpt_oss_imported_with_expert_parallelism(tmp_path):
    hf = _random_gpt_oss(tmp_path / "hf")
    ckpt = str(tmp_path / "ours")
    import_from_hf(str(tmp_path / "hf"), ckpt)
    with torch.no_grad():
        expected = hf(TOKENS).logits
    for logits in run_ranks(_ep2_logits, 2, ckpt, TOKENS):
        assert rel_err(logits, expected) < 1e-5
