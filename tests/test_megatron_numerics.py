"""Megatron-LM flags that change the model's function, checked against megatron-core's own:
--squared-relu (megatron.core.activations.squared_relu), the fused bias-GELU and
--no-bias-gelu-fusion, the attention softmax flags."""

from __future__ import annotations

import math

import pytest
import torch

from engine.errors import ConfigError
from engine.model import BuildContext, GPTModel
from engine.pretrain import parse
from engine.train.preflight import prepare
from tests.harness import tiny_config
from tests.requirements import require
from tests.test_megatron_flags import SHAPE


def test_squared_relu_is_megatron_cores():
    activations = require("megatron.core.activations")
    cfg = tiny_config("gpt2", squared_relu=True)
    mlp = GPTModel(cfg, BuildContext(cfg)).layers["0"].mlp
    x = torch.randn(5, 2, cfg.hidden_size)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    hidden = torch.nn.functional.linear(x, fc1.weight, fc1.bias)
    expected = torch.nn.functional.linear(activations.squared_relu(hidden), fc2.weight, fc2.bias)
    assert torch.equal(mlp(x), expected)
    plain = tiny_config("gpt2")
    gelu = GPTModel(plain, BuildContext(plain)).layers["0"].mlp
    assert not torch.equal(gelu(x), expected)  # the flag changes the function


@pytest.mark.parametrize(
    "changes, fused",
    [({}, True), ({"bias_gelu_fusion": False}, False), ({"add_bias_linear": False}, False)],
    ids=["default", "no-bias-gelu-fusion", "disable-bias-linear"],
)
def test_gelu_with_biases_is_megatron_cores_fused_bias_gelu(changes, fused):
    """Megatron-LM's default GELU MLP with biases runs megatron-core's fused bias-GELU, GELU's
    tanh approximation; --no-bias-gelu-fusion or --disable-bias-linear the exact GELU."""
    require("megatron.core")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

    cfg = tiny_config("gpt2", **changes)
    mlp = GPTModel(cfg, BuildContext(cfg)).layers["0"].mlp
    # inputs large enough (pre-activations of order 1) that the two GELUs part
    x = torch.randn(5, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(0)) * 20
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    hidden = torch.nn.functional.linear(x, fc1.weight)
    bias = fc1.bias if fc1.bias is not None else torch.zeros(hidden.shape[-1])
    if fused:
        active = bias_gelu_impl(hidden, bias)
    else:
        active = torch.nn.functional.gelu(hidden + bias)
    expected = torch.nn.functional.linear(active, fc2.weight, fc2.bias)
    assert (mlp(x) - expected).abs().max() < 1e-5
    exact = torch.nn.functional.gelu(hidden + bias)
    assert fused == bool((active - exact).abs().max() > 1e-4)  # the two GELUs differ


def test_the_gelu_goes_to_megatron_lm_as_it_computes_it():
    from engine.interop.megatron.export import _gelu_args

    assert _gelu_args(tiny_config("gpt2")) == {"openai_gelu": False, "bias_gelu_fusion": True}
    exact = tiny_config("gpt2", bias_gelu_fusion=False)
    assert _gelu_args(exact) == {"openai_gelu": False, "bias_gelu_fusion": False}
    assert not _gelu_args(tiny_config("llama"))["bias_gelu_fusion"]  # SwiGLU, no biases
    with pytest.raises(ConfigError, match="no Megatron-LM equivalent"):
        _gelu_args(tiny_config("gpt2", openai_gelu=True, add_bias_linear=False))


def test_squared_relu_is_refused_beside_swiglu():
    prepare(parse(SHAPE + ["--squared-relu"]), 1)
    with pytest.raises(ConfigError, match="--squared-relu replaces GELU: drop --swiglu"):
        prepare(parse(SHAPE + ["--squared-relu", "--swiglu"]), 1)


def test_distributed_backend_is_checked_against_the_device():
    on_cpu = SHAPE + ["--device", "cpu"]
    prepare(parse(on_cpu + ["--distributed-backend", "gloo"]), 1)
    with pytest.raises(ConfigError, match="--distributed-backend nccl needs CUDA GPUs"):
        prepare(parse(on_cpu + ["--distributed-backend", "nccl"]), 1)


def _deterministic_run(rank, world, argv):
    import logging
    import os

    from engine.pretrain import main

    code = main(argv)
    enabled = torch.are_deterministic_algorithms_enabled()
    return code, enabled, os.environ.get("CUBLAS_WORKSPACE_CONFIG"), logging.getLogger().level


def test_deterministic_mode_and_logging_level(dataset_prefix, tokenizer_model, tmp_path):
    from tests.distributed import run_ranks
    from tests.test_training import base_args, losses

    logs = []
    for name in ("a", "b"):
        log = str(tmp_path / f"{name}.jsonl")
        args = base_args(
            dataset_prefix, tokenizer_model, **{"--train-iters": "3", "--log-jsonl": log}
        )
        extra = ["--deterministic-mode", "--device", "cpu", "--logging-level", "15"]
        results = run_ranks(_deterministic_run, 2, args + extra)
        assert results == [(0, True, ":4096:8", 15)] * 2  # (and --logging-level's level)
        logs.append(losses(log))
    assert logs[0] == logs[1]  # bit for bit


def test_deterministic_mode_on_gpus_needs_nccl_algo(monkeypatch):
    from engine.train.preflight import _check_deterministic_gpu

    monkeypatch.delenv("NCCL_ALGO", raising=False)
    with pytest.raises(ConfigError, match="--deterministic-mode: set NCCL_ALGO to one of Tree"):
        _check_deterministic_gpu(parse(SHAPE).runtime)
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    _check_deterministic_gpu(parse(SHAPE).runtime)
    with pytest.raises(ConfigError, match="with --use-fused-kernels"):
        _check_deterministic_gpu(parse(SHAPE + ["--use-fused-kernels"]).runtime)


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rotary_interleaved_is_megatron_cores(percent):
    """--rotary-interleaved: pairs of adjacent channels turn, equal to megatron-core's
    interleaved table (RotaryEmbedding(rotary_interleaved=True)'s layout) and rotation
    (_apply_rotary_pos_emb_bshd(rotary_interleaved=True)), also on a partial rotation."""
    import warnings

    from engine.config.model import ModelConfig
    from engine.model.attention import SelfAttention
    from engine.model.rope import RotaryEmbedding

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rope = require("megatron.core.models.common.embeddings.rope_utils")
        from megatron.core.models.common.embeddings import rotary_pos_embedding

    common = dict(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=64)
    common |= dict(position_embedding_type="rope", rotary_percent=percent)
    cfg = ModelConfig(**common, rotary_interleaved=True)
    cfg.validate()
    table = rotary_pos_embedding.RotaryEmbedding(
        kv_channels=16, rotary_percent=percent, rotary_interleaved=True, use_cpu_initialization=True
    )
    freqs = table.get_freqs_non_repeated(12)  # get_emb's interleaved layout, on the CPU
    freqs = torch.stack((freqs, freqs), dim=-1).view(12, -1)[:, None, None, :]
    x = torch.randn(12, 2, 4, 16, dtype=torch.float64)
    theirs = rope._apply_rotary_pos_emb_bshd(x, freqs.double(), rotary_interleaved=True)
    cos, sin = RotaryEmbedding(cfg.rotary_dim, cfg.rotary_base)(torch.arange(12))
    ours = SelfAttention(BuildContext(cfg), 0)._rotate(x, (cos.double(), sin.double()))
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    plain = ModelConfig(**common)
    halves = SelfAttention(BuildContext(plain), 0)._rotate(x, (cos.double(), sin.double()))
    assert not torch.allclose(halves, theirs)  # the flag changes the rotation


def _megatron_core_attention(scaling: bool, fp32_softmax: bool, layer: int):
    """megatron-core's unfused attention softmax (FusedScaleMaskSoftmax, built and fed as its
    DotProductAttention builds and feeds it: bf16 scores scaled by 1/sqrt(d), divided by the
    layer number with the layer scaling, which the softmax multiplies back) and tripod's
    attention kernel on the same bf16 q, k, v; each one's largest error against float64, and
    the largest difference between them. (DotProductAttention itself needs a CUDA buffer.)"""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    from engine.model.attention_kernel import AttentionKernel, AttentionMasks

    generator = torch.Generator().manual_seed(layer)
    q, k, v = (torch.randn(2, 4, 48, 32, generator=generator).bfloat16() * 3 for _ in range(3))
    scale, coeff = 1.0 / math.sqrt(32), None
    if scaling:
        coeff = layer
        scale /= coeff
    softmax = FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=True,
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False,
        mask_func=attention_mask_func,
        softmax_in_fp32=fp32_softmax,
        scale=coeff,
    )
    scores = torch.baddbmm(
        torch.empty(8, 48, 48, dtype=torch.bfloat16),
        q.reshape(8, 48, 32),
        k.reshape(8, 48, 32).transpose(1, 2),
        beta=0.0,
        alpha=scale,
    )
    future = torch.ones(1, 1, 48, 48, dtype=torch.bool).triu(1)  # its mask: True is hidden
    probs = softmax(scores.view(2, 4, 48, 48), future)
    theirs = torch.bmm(probs.view(8, 48, 48), v.reshape(8, 48, 32)).view(2, 4, 48, 32).float()
    ours = AttentionKernel("sdpa-causal", None, False, AttentionMasks())(q, k, v, 0.0).float()
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True
    )
    return (
        (theirs - exact).abs().max().item(),
        (ours - exact).abs().max().item(),
        (theirs - ours).abs().max().item(),
    )


@pytest.mark.parametrize(
    "scaling, fp32_softmax",
    # megatron-core's config turns the fp32 softmax on with the layer scaling
    [(True, True), (False, True), (False, False)],
)
def test_attention_softmax_in_fp32_and_query_key_layer_scaling(scaling, fp32_softmax):
    """--attention-softmax-in-fp32 and --apply-query-key-layer-scaling, "already what tripod
    does": its attention keeps the scores and the softmax in fp32 inside the kernel, so it is
    never further from the float64 result than megatron-core's unfused bf16 attention with
    either flag (which rounds the scores and the probabilities to bf16: ~0.2 off on these
    inputs, tripod ~0.03); the flags ask for precision tripod always has."""
    require("megatron.core")
    for layer in (1, 3):
        theirs, ours, _ = _megatron_core_attention(scaling, fp32_softmax, layer)
        assert ours <= theirs and ours < 0.05, (layer, ours, theirs)
