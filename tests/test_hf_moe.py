"""Hugging Face mixtures of experts in and out: random Mixtral, Qwen2-MoE (shared experts behind
their gate, a dense first layer, un-normalised top-k), Qwen3-MoE (normalised top-k, per-head
query and key norms) and OLMoE (query and key norms over all heads at once, un-normalised top-k)
made by transformers come back bit-identical after import and export, give
transformers' logits within 1e-5 imported under TP 2 (sequence parallel) x EP 2, and load back
into transformers from our export with the same logits; what HF cannot express is refused in
one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine.checkpoint.files import iteration_dir, read_meta
from engine.checkpoint.load import load_model_weights
from engine.config.model import ModelConfig
from engine.errors import ConfigError
from engine.interop.hf.architectures import model_config_from_hf, style_of
from engine.interop.hf.export import export_to_hf
from engine.interop.hf.import_hf import import_from_hf
from tests.distributed import rel_err, run_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STYLES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=500,
    max_position_embeddings=64,
    num_experts_per_tok=2,
)


def _random_hf_moe(style: str, folder):
    import transformers

    torch.manual_seed(0)
    if style == "mixtral":
        config = transformers.MixtralConfig(**SHAPE, num_local_experts=4)
        model = transformers.MixtralForCausalLM(config)
    elif style == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **SHAPE,
            num_experts=4,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            mlp_only_layers=[0],
            norm_topk_prob=False,
        )
        model = transformers.Qwen2MoeForCausalLM(config)
    elif style == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **SHAPE, num_experts=4, moe_intermediate_size=48, norm_topk_prob=True, head_dim=16
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.OlmoeConfig(**SHAPE, num_experts=4, norm_topk_prob=False)
        model = transformers.OlmoeForCausalLM(config)
    with torch.no_grad():  # norms, biases and routers away from their initial values
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias") or ".gate." in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    return model.eval()


TOKENS = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("style", STYLES)
def test_hf_moe_round_trip_and_logits(tmp_path, style):
    import transformers

    hf = _random_hf_moe(style, tmp_path / "hf")
    summary = import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert summary["architecture"] == style
    export_to_hf(str(tmp_path / "ours"), str(tmp_path / "again"))
    before, after = same_tensors(tmp_path / "hf", tmp_path / "again")
    experts = [c.get("num_experts", c.get("num_local_experts")) for c in (before, after)]
    assert experts[0] == experts[1] == 4
    moe_keys = (
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
        "mlp_only_layers",
        "qkv_bias",
        "intermediate_size",
    )
    for key in moe_keys:
        if key in before:
            assert after[key] == before[key], key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        expected = hf(TOKENS).logits
        assert rel_err(reloaded(TOKENS).logits, expected) < 1e-6


def same_tensors(folder, again) -> tuple[dict, dict]:
    """Assert the two HF folders hold bit-identical tensors; their config.json files."""
    from safetensors.torch import load_file

    original = load_file(folder / "model.safetensors")
    other = load_file(again / "model.safetensors")
    assert original.keys() == other.keys()
    for key, value in original.items():
        assert torch.equal(value, other[key]), key
    configs = []
    for where in (folder, again):
        with open(where / "config.json") as f:
            configs.append(json.load(f))
    return configs[0], configs[1]


def _tp2_ep2_logits(rank, world, ckpt, tokens):
    from engine.model.builder import build_model_chunks
    from parallel.state import ParallelState

    state = ParallelState.build(tp=2, ep=2)  # experts split over TP too (ETP = TP)
    path = iteration_dir(ckpt, 0)
    cfg = ModelConfig(**read_meta(path)["model"])
    (model,) = build_model_chunks(cfg, state, sequence_parallel=True)
    load_model_weights(path, model.eval())
    with torch.no_grad():
        return model.full_logits(model(tokens=tokens))


@pytest.mark.parametrize("style", STYLES)
def test_transformers_moe_imported_under_tp2_ep2(tmp_path, style):
    hf = _random_hf_moe(style, tmp_path / "hf")
    ckpt = str(tmp_path / "ours")
    import_from_hf(str(tmp_path / "hf"), ckpt)
    with torch.no_grad():
        expected = hf(TOKENS).logits
    for logits in run_ranks(_tp2_ep2_logits, 4, ckpt, TOKENS):
        assert rel_err(logits, expected) < 1e-5


def test_what_hf_cannot_express_is_refused_in_one_line():
    base = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        max_position_embeddings=16,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        num_experts=4,
    )
    assert style_of(base) == "mixtral"
    for options, problem in (
        (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
        (dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor"),
        (dict(moe_layer_freq="[0,1]"), "dense layers between the MoE layers"),
        (
            dict(moe_shared_expert_intermediate_size=16),
            "shared experts without --moe-shared-expert-gate",
        ),
        (dict(qk_layernorm=True, add_qkv_bias=True), "--add-qkv-bias with --qk-layernorm"),
    ):
        with pytest.raises(ConfigError, match=problem) as err:
            style_of(ModelConfig(**{**base.__dict__, **options}))
        assert "\n" not in str(err.value)
    olmoe = dict(SHAPE, model_type="olmoe", num_experts=4)
    with pytest.raises(ConfigError, match="OLMoE's clip_qkv 8.0"):
        model_config_from_hf(olmoe | {"clip_qkv": 8.0})
    across = dict(qk_layernorm=True, qk_layernorm_across_heads=True)
    dense = {**base.__dict__, "num_experts": None} | across
    with pytest.raises(ConfigError, match="--qk-layernorm-across-heads has no equivalent"):
        style_of(ModelConfig(**dense))
    with pytest.raises(ConfigError, match="shared experts with --qk-layernorm-across-heads"):
        style_of(
            ModelConfig(
                **base.__dict__
                | across
                | {"moe_shared_expert_intermediate_size": 16, "moe_shared_expert_gate": True}
            )
        )
