"""Multi-latent attention (--multi-latent-attention): one layer against megatron-core 0.16.1's
MLASelfAttention on the same weights and inputs (fp64; with and without the query latent, YaRN
with its softmax-scale correction, the latent norms; output and every weight's gradient), the
output-discarding recomputation of the up projections (--recompute-modules mla_up_proj), and the
flags it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config.model import ModelConfig
from engine.errors import ConfigError
from engine.model import BuildContext
from engine.model.latent_attention import LatentAttention
from engine.model.rope import RotaryEmbedding
from tests.distributed import rel_err, run_ranks
from tests.requirements import require

SEQ, B, HIDDEN, HEADS = 12, 2, 24, 4
MLA = dict(
    num_layers=2,
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    seq_length=SEQ,
    vocab_size=64,
    multi_latent_attention=True,
    position_embedding_type="rope",
    normalization="RMSNorm",
    qk_layernorm=True,
    add_bias_linear=False,
    kv_lora_rank=10,
    qk_head_dim=6,
    qk_pos_emb_head_dim=4,
    v_head_dim=5,
    rotary_scaling_factor=40.0,
    mscale=1.0,
    mscale_all_dim=0.7,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
SETTINGS = {
    "query latent, yarn": dict(q_lora_rank=12),
    "no query latent, yarn": dict(q_lora_rank=None),
    "query latent, plain rope": dict(q_lora_rank=12, rope_type="rope"),
}


def _config(**overrides) -> ModelConfig:
    return ModelConfig(**(MLA | overrides))


def _hidden(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SEQ, B, HIDDEN, generator=gen, dtype=torch.float64)


def _ours(cfg: ModelConfig, x: torch.Tensor):
    ctx = BuildContext(cfg, params_dtype=torch.float64)
    layer = LatentAttention(ctx, 0)
    rotary = RotaryEmbedding.for_config(cfg)(torch.arange(SEQ))
    return layer, layer(x, rotary)


class _ReferenceCoreAttention(torch.nn.Module):
    def __init__(self, *, softmax_scale, **_):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, **_):  # [s, b, heads, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        scores = (q @ k.transpose(-1, -2) * self.softmax_scale).masked_fill(attention_mask, -1e30)
        out = torch.softmax(scores, dim=-1) @ v  # [b, heads, s, dv]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def _megatron(rank, world, overrides, weights, x):
    """megatron-core's MLASelfAttention (its local spec, PyTorch attention) on our weights."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer import multi_latent_attention as mla_module
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from tools.megatron_cpu import CPU_CONFIG, cuda_queries_on_cpu, cuda_tensors_on_cpu

    cuda_queries_on_cpu()
    cuda_tensors_on_cpu()
    # its module finds megatron's Transformer Engine wrappers importable (as None) without
    # Transformer Engine and then tests isinstance against None; it has none here
    mla_module.HAVE_TE = False
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    get_cuda_rng_tracker().add("model-parallel-rng", 1234)
    cfg = MLA | overrides
    config = MLATransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
        q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
        qk_head_dim=cfg["qk_head_dim"], qk_pos_emb_head_dim=cfg["qk_pos_emb_head_dim"],
        v_head_dim=cfg["v_head_dim"], rope_type=cfg.get("rope_type") or "yarn",
        rotary_scaling_factor=cfg["rotary_scaling_factor"], mscale=cfg["mscale"],
        mscale_all_dim=cfg["mscale_all_dim"], original_max_position_embeddings=4096,
        normalization="RMSNorm", add_bias_linear=False, params_dtype=torch.float64,
        qk_layernorm=True, **CPU_CONFIG,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(
        multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"
    ).submodules.self_attention
    # megatron-core's PyTorch DotProductAttention takes no separate value width (MLA runs on
    # Transformer Engine's); in its place, causal softmax(q k^T x the softmax_scale MLA hands
    # it) v, which is all that kernel computes
    spec.submodules.core_attention = _ReferenceCoreAttention
    attention = build_module(spec, config=config, layer_number=1)
    attention = attention.double()
    params = dict(attention.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    hidden = x.clone().requires_grad_()
    out, _ = attention(hidden, causal)
    out.backward(torch.ones_like(out))
    grads = {name: params[name].grad for name in weights}
    return out.detach(), hidden.grad, grads


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_latent_attention_equals_megatron_cores_mla(setting):
    require("megatron.core")
    cfg = _config(**SETTINGS[setting])
    x = _hidden()
    hidden = x.clone().requires_grad_()
    layer, out = _ours(cfg, hidden)
    out.backward(torch.ones_like(out))
    # megatron-core's names are ours (its local spec keeps the latent norms apart)
    weights = {name: p.detach() for name, p in layer.named_parameters()}
    ((theirs, their_input_grad, their_grads),) = run_ranks(
        _megatron, 1, SETTINGS[setting], weights, x
    )
    # (RoPE turns in fp32 on both sides, as the fused kernels do: fp32 agreement, not fp64's)
    assert rel_err(out, theirs) < 1e-6
    assert rel_err(hidden.grad, their_input_grad) < 1e-6
    for name, param in layer.named_parameters():
        assert rel_err(param.grad, their_grads[name]) < 1e-6, name


def test_softmax_scale_correction_changes_the_output():
    """The YaRN correction (--mscale-all-dim) is in the attention: without it, other numbers."""
    x = _hidden()
    _, corrected = _ours(_config(q_lora_rank=12), x)
    _, plain = _ours(_config(q_lora_rank=12, mscale_all_dim=0.0), x)
    assert rel_err(corrected, plain) > 1e-3


def test_up_projection_recompute_frees_and_refills_the_full_keys():
    """mla_up_proj: the up projections run twice (forward, then before core attention's
    backward), their outputs' memory is released in between, and the gradients are unchanged."""
    cfg = _config(q_lora_rank=12)
    recomputing = dataclasses.replace(
        cfg, recompute_granularity="selective", recompute_modules=["mla_up_proj"]
    )
    x = _hidden()
    results = []
    for config in (cfg, recomputing):
        hidden = x.clone().requires_grad_()
        layer = LatentAttention(BuildContext(config, params_dtype=torch.float64), 0)
        calls = []  # the outputs of every run of the up projections
        up = layer._up

        def counted(*args, _up=up, _calls=calls):
            outputs = _up(*args)
            _calls.append(outputs)
            return outputs

        layer._up = counted
        rotary = RotaryEmbedding.for_config(config)(torch.arange(SEQ))
        out = layer(hidden, rotary)
        freed = [t.untyped_storage().nbytes() == 0 for t in calls[0]]
        out.backward(torch.ones_like(out))
        grads = {n: p.grad for n, p in layer.named_parameters()}
        results.append((out.detach(), hidden.grad, grads, len(calls), freed))
    (out, x_grad, grads, calls, freed), (out2, x_grad2, grads2, calls2, freed2) = results
    assert (calls, calls2) == (1, 2)
    assert not any(freed) and all(freed2)
    assert torch.equal(out, out2) and torch.equal(x_grad, x_grad2)
    for name in grads:
        assert torch.equal(grads[name], grads2[name]), name


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(group_query_attention=True, num_query_groups=2), "--group-query-attention"),
        (dict(position_embedding_type="learned_absolute"), "--position-embedding-type"),
        (dict(use_rope_scaling=True), "--use-rope-scaling"),
        (dict(rotary_interleaved=True), "--rotary-interleaved"),
        (dict(softmax_type="learnable"), "--softmax-type"),
        (dict(window_size="(4, 0)"), "--window-size"),
        (dict(qk_pos_emb_head_dim=5), "--qk-pos-emb-head-dim"),
        (dict(kv_lora_rank=0), "--kv-lora-rank"),
    ],
)
def test_refused_with_latent_attention(overrides, flag):
    with pytest.raises(ConfigError, match=flag):
        _config(**overrides).validate()


def test_latent_flags_refused_without_it():
    with pytest.raises(ConfigError, match="--rope-type yarn"):
        ModelConfig(rope_type="yarn").validate()
    with pytest.raises(ConfigError, match="mla_up_proj needs --multi-latent-attention"):
        ModelConfig(recompute_granularity="selective", recompute_modules=["mla_up_proj"]).validate()


LAYOUTS = {
    "tp2-sp": dict(tp=2),
    "tp2": dict(tp=2, sp=False),
    "cp2": dict(cp=2),
    "pp2": dict(pp=2),
    "dp2": dict(),
}


def _model_config(**overrides):
    from tests.harness import tiny_config

    return tiny_config(
        "llama", group_query_attention=False, num_query_groups=None, **(MLA_MODEL | overrides)
    )


MLA_MODEL = dict(
    multi_latent_attention=True,
    q_lora_rank=12,
    kv_lora_rank=10,
    qk_head_dim=6,
    qk_pos_emb_head_dim=4,
    v_head_dim=5,
    qk_layernorm=True,
    rotary_scaling_factor=4.0,
    mscale_all_dim=1.0,
    yarn_original_max_position_embeddings=4,
)


def _layout(rank, world, name, recompute):
    from parallel.state import ParallelState
    from tests.harness import compare_params, engine_grads, global_batch, reference_grads

    layout = LAYOUTS[name]
    state = ParallelState.build(
        tp=layout.get("tp", 1), pp=layout.get("pp", 1), cp=layout.get("cp", 1)
    )
    extra = {
        "up": dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]),
        "full": dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1),
    }.get(recompute, {})  # fmt: skip
    cfg = _model_config(**extra)
    tokens = global_batch(3, 4, cfg.seq_length)
    _, ref_grads = reference_grads(_model_config(), tokens)
    _, grads = engine_grads(
        state, cfg, tokens, 2 // state.dp_size,
        sequence_parallel=layout.get("tp", 1) > 1 and layout.get("sp", True),
    )  # fmt: skip
    return max(compare_params(grads, ref_grads).values())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_latent_attention_model_matches_one_process(name):
    """Loss gradients of every weight under TP2 (with and without SP: the replicated down
    projections and latent norms, the shared RoPE key), CP2 (ring, values padded), PP2 and
    DP2 equal one process's; with the up projections, or whole layers, recomputed under
    TP2+SP."""
    for recompute in (None, "up", "full") if name == "tp2-sp" else (None,):
        for error in run_ranks(_layout, 2, name, recompute):
            assert error < 1e-5, (name, recompute, error)


def test_context_parallel_other_than_ring_is_refused():
    from tests.cli import one_line_error, run_python

    argv = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--train-iters", "3", "--multi-latent-attention", "--position-embedding-type", "rope",
        "--attention-dropout", "0", "--context-parallel-size", "2", "--cp-comm-type", "a2a",
    ]  # fmt: skip
    env = {"WORLD_SIZE": "2", "RANK": "0"}
    error = one_line_error(run_python("-m", "engine.pretrain", *argv, env=env))
    assert "--cp-comm-type a2a with --multi-latent-attention" in error


def _latent_on(device, dtype, documents: bool):
    """A ~DeepSeek-V3-shaped MLA layer (query and key width 64, values 32) built for `device`
    in `dtype` with the fp64 CPU layer's weights: (the layer, output and gradients) beside
    the fp64 layer's own."""
    from engine.model.document_attention import Documents

    s, b = 256, 2
    cfg = _config(
        seq_length=s, hidden_size=256, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64,
        qk_head_dim=48, qk_pos_emb_head_dim=16, v_head_dim=32,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(s, b, 256, generator=gen, dtype=torch.float64)
    grad = torch.randn(s, b, 256, generator=gen, dtype=torch.float64)
    ids = torch.zeros(b, s, dtype=torch.long)
    if documents:
        ids[0, 100:], ids[1, 30:170], ids[1, 170:] = 1, 1, 2
    results = []
    for where, kind in ((device, dtype), ("cpu", torch.float64)):
        ctx = BuildContext(cfg, params_dtype=kind, device=where, gradient_accumulation_fusion=False)
        layer = LatentAttention(ctx, 0).to(where)
        if results:
            layer.load_state_dict(results[0][0].state_dict())
        inp = x.to(where, kind).requires_grad_()
        rotary = RotaryEmbedding.for_config(cfg, where)(torch.arange(s, device=where))
        out = layer(inp, rotary, Documents(ids.to(where)) if documents else None)
        out.backward(grad.to(where, kind))
        grads = {"input": inp.grad} | {n: p.grad for n, p in layer.named_parameters()}
        results.append((layer, out, grads))
    return results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("documents", [False, True])
def test_latent_attention_on_the_gpu_kernels_equals_fp64(dtype, tolerance, documents):
    """On CUDA the values keep their own width through the fused kernels (no padding; within
    documents, compiled FlexAttention): output and every gradient against the layer in fp64
    on the CPU (relative to each tensor's largest value)."""
    (gpu, out, grads), (_, expected, wanted) = _latent_on("cuda", dtype, documents)
    assert gpu.width is None
    assert rel_err(out.double().cpu(), expected) < tolerance
    for name, got in grads.items():
        assert rel_err(got.double().cpu(), wanted[name]) < tolerance * 4, name
