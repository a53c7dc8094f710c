"""Attention sinks (--softmax-type off-by-one / learnable) and windows on some layers only
(--window-attn-skip-freq), gpt-oss's attention: the kernel against transformers' GptOss
attention and megatron-core 0.16.1's DotProductAttention on the same inputs (fp64, forward and
backward, the sinks' gradient included), and the model under TP2 (the sinks split with the
heads), CP2 (ring and all-gather) and PP2 against one process."""

from __future__ import annotations

import types

import pytest
import torch

from engine.model.attention_sinks import sink_attention
from parallel.state import ParallelState
from tests.distributed import run_ranks
from tests.harness import compare_params, engine_grads, global_batch, reference_grads, tiny_config
from tests.requirements import require

B, HEADS, GROUPS, SEQ, D = 2, 4, 2, 24, 8


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, HEADS, SEQ, D), (B, GROUPS, SEQ, D), (B, GROUPS, SEQ, D), (HEADS,)]
    return [torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]


def _allowed(window):
    pos = torch.arange(SEQ)
    allowed = pos[:, None] >= pos[None, :]
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] <= window
    return allowed


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("off_by_one", [False, True])
def test_sink_attention_equals_transformers_gpt_oss_attention(window, off_by_one):
    modeling = require("transformers.models.gpt_oss.modeling_gpt_oss")
    q, k, v, sink = _inputs()
    if off_by_one:
        sink = torch.zeros(HEADS, dtype=torch.float64, requires_grad=True)
    out = sink_attention(q, k, v, sink, window)
    module = types.SimpleNamespace(sinks=sink, num_key_value_groups=HEADS // GROUPS, training=False)
    mask = torch.zeros(SEQ, SEQ, dtype=torch.float64).masked_fill(~_allowed(window), -torch.inf)
    theirs, _ = modeling.eager_attention_forward(module, q, k, v, mask, D**-0.5)
    theirs = theirs.transpose(1, 2)
    assert (out - theirs).abs().max() < 1e-12
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v, sink), grad)
    expected = torch.autograd.grad(theirs, (q, k, v, sink), grad)
    for name, a, b in zip("qkvs", ours, expected, strict=True):
        assert (a - b).abs().max() < 1e-12, name
    plain = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=_allowed(window), enable_gqa=True
    )
    assert (plain - out).abs().max() > 1e-3  # the sink takes probability away


def _megatron(rank, world, window):
    """megatron-core's DotProductAttention (its PyTorch path) with a learnable softmax offset
    and the same window, on the same inputs: output and the offset's gradient."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tools.megatron_cpu import CPU_CONFIG, cuda_queries_on_cpu, cuda_tensors_on_cpu

    cuda_queries_on_cpu()
    cuda_tensors_on_cpu()
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    get_cuda_rng_tracker().add("model-parallel-rng", 1234)  # (no dropout: never drawn from)
    config = TransformerConfig(
        num_layers=2, hidden_size=HEADS * D, num_attention_heads=HEADS,
        num_query_groups=GROUPS, softmax_type="learnable", params_dtype=torch.float64,
        window_size=None if window is None else (window, 0), window_attn_skip_freq=2,
        **CPU_CONFIG,
    )  # fmt: skip
    # layer 1 (counted from 1) is windowed with skip-frequency 2, layer 2 attends fully
    attention = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v, sink = _inputs()
    with torch.no_grad():
        attention.softmax_offset.copy_(sink)
    causal = ~_allowed(None)[None, None]
    mine = [t.permute(2, 0, 1, 3).detach().requires_grad_() for t in (q, k, v)]  # [s, b, h, d]
    out = attention(*mine, causal)  # [s, b, h * d]
    out.backward(torch.ones_like(out))
    return out.detach(), attention.softmax_offset.grad


@pytest.mark.parametrize("window", [None, 5])
def test_sink_attention_equals_megatron_cores_softmax_offset(window):
    require("megatron.core")
    ((theirs, their_grad),) = run_ranks(_megatron, 1, window)
    q, k, v, sink = _inputs()
    out = sink_attention(q, k, v, sink, window)
    ours = out.permute(2, 0, 1, 3).reshape(SEQ, B, HEADS * D)
    assert (ours - theirs).abs().max() < 1e-12
    ours.backward(torch.ones_like(ours))
    assert (sink.grad - their_grad).abs().max() < 1e-10


def test_skip_frequency_picks_megatron_cores_windowed_layers():
    utils = require("megatron.core.transformer.utils")
    for freq, text in ((2, "2"), (3, "3"), ([1, 0, 0, 1], "([1,0]+[0,1])")):
        cfg = tiny_config("llama", window_size="(4, 0)", window_attn_skip_freq=text)
        for layer in range(cfg.num_layers):  # megatron-core counts layers from 1
            theirs = utils.is_layer_window_attention((4, 0), freq, layer + 1)
            assert (cfg.window_of(layer) == 4) == theirs, (freq, layer)


LAYOUTS = {
    "tp2": dict(tp=2),
    "cp2-p2p": dict(cp=2, comm="p2p"),
    "cp2-allgather": dict(cp=2, comm="allgather"),
    "cp2-a2a": dict(cp=2, comm="a2a"),
    "pp2": dict(pp=2),
}


def _config():
    return tiny_config(
        "llama", softmax_type="learnable", window_size="(5, 0)", window_attn_skip_freq="2"
    )


def _layout(rank, world, name):
    layout = LAYOUTS[name]
    state = ParallelState.build(
        tp=layout.get("tp", 1), pp=layout.get("pp", 1), cp=layout.get("cp", 1)
    )
    cfg = _config()
    tokens = global_batch(5, 4 * state.dp_size, cfg.seq_length)
    ref_loss, ref_grads = reference_grads(cfg, tokens)
    _, grads = engine_grads(
        state, cfg, tokens, 2, cp_comm_type=(layout.get("comm", "p2p"),),
        sequence_parallel=layout.get("tp", 1) > 1,
    )  # fmt: skip
    sinks = [n for n in grads if n.endswith("softmax_offset")]
    return max(compare_params(grads, ref_grads).values()), sinks


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sinks_and_alternating_windows_match_one_process(name):
    found = []
    for error, sinks in run_ranks(_layout, 2, name):
        assert error < 1e-5, (name, error)
        found += sinks
    assert any("core_attention.softmax_offset" in n for n in found)


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--softmax-type learnable with --attention-dropout 0.1: dropout on the"),
        (
            ["--attention-dropout", "0", "--window-size", "(8, 0)", "--window-attn-skip-freq",
             "([1,0]*3)"],
            "--window-attn-skip-freq ([1,0]*3): gives 6 layers, the model has --num-layers 4",
        ),
    ],
)  # fmt: skip
def test_bad_sink_and_window_flags_are_one_line(extra, message):
    from tests.cli import one_line_error, run_python

    argv = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--train-iters", "3", "--softmax-type", "learnable", *extra,
    ]  # fmt: skip
    env = {"WORLD_SIZE": "2", "RANK": "0"} if "--context-parallel-size" in extra else None
    assert message in one_line_error(run_python("-m", "engine.pretrain", *argv, env=env))


def test_quick_geglu_with_clamp_and_offset_is_gpt_oss_experts_activation():
    """--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7: an expert's MLP
    equals transformers' GptOssExperts on the same weights (its gate and up columns
    interleaved, ours stacked), forward and backward, with values past the clamp."""
    from engine.model import BuildContext
    from engine.model.mlp import MLP

    modeling = require("transformers.models.gpt_oss.modeling_gpt_oss")
    transformers = require("transformers")
    hidden, ffn = 16, 12
    cfg = tiny_config(
        "llama", hidden_size=hidden, ffn_hidden_size=ffn, swiglu=False, quick_geglu=True,
        glu_linear_offset=1.0, activation_func_clamp_value=7.0, add_bias_linear=True,
    )  # fmt: skip
    ours = MLP(BuildContext(cfg, params_dtype=torch.float64), 0)
    config = transformers.GptOssConfig(
        hidden_size=hidden, intermediate_size=ffn, num_local_experts=1, swiglu_limit=7.0
    )
    theirs = modeling.GptOssExperts(config).double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        gate_up, bias = theirs.gate_up_proj[0], theirs.gate_up_proj_bias[0]  # [h, 2f], [2f]
        ours.linear_fc1.weight.copy_(torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], 1).t())
        ours.linear_fc1.bias.copy_(torch.cat([bias[::2], bias[1::2]]))
        ours.linear_fc2.weight.copy_(theirs.down_proj[0].t())
        ours.linear_fc2.bias.copy_(theirs.down_proj_bias[0])
    x = (3 * torch.randn(10, hidden, generator=gen, dtype=torch.float64)).requires_grad_()
    expected = theirs(
        x, torch.zeros(10, 1, dtype=torch.long), torch.ones(10, 1, dtype=torch.float64)
    )
    got = ours(x[:, None])[:, 0]  # [s, b, h]
    assert (got - expected).abs().max() < 1e-10
    assert (ours.linear_fc1(x[:, None]).abs() > 7).any()  # the clamp is reached
    grads = [torch.autograd.grad(y.sum(), x)[0] for y in (got, expected)]
    assert (grads[0] - grads[1]).abs().max() < 1e-10


@pytest.mark.parametrize("window", [None, 3])
def test_sinks_within_documents_equal_the_explicit_softmax(window):
    """Sinks beside each row's own document's scores (--reset-attention-mask): fp64, forward
    and backward, against the scores masked to the document (and window) with the sink
    column, softmaxed, the sink's share dropped."""
    from engine.model.attention_kernel import AttentionKernel, AttentionMasks
    from engine.model.document_attention import Documents, allowed

    q, k, v, sink = _inputs(1)
    ids = torch.tensor([[0] * 7 + [1] * 10 + [2] * 7, [0] * 24])
    kernel = AttentionKernel("sinks", window, True, AttentionMasks(), "sdpa-documents")
    out = kernel(q, k, v, 0.0, Documents(ids), sink)
    grads = torch.autograd.grad(out.sum(), (q, k, v, sink))
    keys, values = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (k, v))
    scores = q @ keys.transpose(-1, -2) / D**0.5
    scores = scores.masked_fill(~allowed(ids, window), float("-inf"))
    column = sink[None, :, None, None].expand(B, HEADS, SEQ, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    expected = probs @ values
    assert (out - expected).abs().max() < 1e-12
    wanted = torch.autograd.grad(expected.sum(), (q, k, v, sink))
    for got, want in zip(grads, wanted, strict=True):
        assert (got - want).abs().max() < 1e-10


DOCUMENT_LAYOUTS = {
    "one": dict(),
    "cp2-p2p": dict(cp=2, comm="p2p"),
    "cp2-a2a": dict(cp=2, comm="a2a"),
    "cp2-allgather": dict(cp=2, comm="allgather"),
    "pp2": dict(pp=2),
    "tp2-sp": dict(tp=2),
}


def _within_documents(rank, world, name):
    from tests.test_packed_documents import PACKING, packed_tokens

    layout = DOCUMENT_LAYOUTS[name]
    tp = layout.get("tp", 1)
    state = ParallelState.build(tp=tp, pp=layout.get("pp", 1), cp=layout.get("cp", 1))
    cfg = _config()
    tokens = packed_tokens(3, 4, cfg.seq_length)
    _, grads = engine_grads(
        state, cfg, tokens, 4 // state.dp_size, cp_comm_type=(layout.get("comm", "p2p"),),
        sequence_parallel=tp > 1, packing=PACKING, per_token_loss=True,
    )  # fmt: skip
    return grads


@pytest.mark.parametrize("name", [n for n in DOCUMENT_LAYOUTS if n != "one"])
def test_sinks_within_documents_match_one_process(name):
    (reference,) = run_ranks(_within_documents, 1, "one")
    for grads in run_ranks(_within_documents, 2, name):
        assert max(compare_params(grads, reference).values()) < 1e-5, name


def _explicit_sink_softmax(q, k, v, sink, ids, window):
    """The reference: [b, heads, s, s] scores masked to the document and window, the sink
    logit as one more column, softmaxed, the sink's share dropped (any dtype)."""
    from engine.model.document_attention import allowed

    heads, d = q.shape[1], q.shape[-1]
    keys, values = (t.repeat_interleave(heads // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ keys.transpose(-1, -2) / d**0.5).masked_fill(~allowed(ids, window), -torch.inf)
    column = sink[None, :, None, None].expand(*scores.shape[:3], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1] @ values


def _sinks_against_explicit(device, dtype, tolerance, window, documents):
    """The path of --softmax-type learnable as a model on `device` picks it (on CUDA the
    memory-efficient kernel with the merged log-sum-exp, the tiled path with a window, one
    document at a time under --reset-attention-mask), forward and backward with the sinks'
    gradient, GQA, against the explicit sink softmax in fp64 on the CPU."""
    from engine.model.attention_kernel import (
        AttentionKernel,
        AttentionMasks,
        choose_document_kernel,
        choose_kernel,
    )
    from engine.model.document_attention import Documents

    gen = torch.Generator().manual_seed(13)
    b, heads, groups, s, d = 2, 8, 2, 512, 64
    shapes = [(b, heads, s, d), (b, groups, s, d), (b, groups, s, d), (heads,)]
    inputs = [torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in shapes]
    grad = torch.randn(b, heads, s, d, generator=gen, dtype=torch.float64)
    ids = torch.zeros(b, s, dtype=torch.long)
    if documents:
        ids[0, 200:350], ids[0, 350:] = 1, 2
        ids[1, 37:] = 1
    kind = choose_kernel(device, dtype, True, window, 0.0, True)
    document_kind = choose_document_kernel(device, 0.0)
    kernel = AttentionKernel(kind, window, True, AttentionMasks(), document_kind)
    low = [t.to(device, dtype).requires_grad_() for t in inputs]
    out = kernel(*low[:3], 0.0, Documents(ids.to(device)) if documents else None, low[3])
    out.backward(grad.to(device, dtype))
    full = [t.clone().requires_grad_() for t in inputs]
    expected = _explicit_sink_softmax(*full, ids, window)
    expected.backward(grad)
    assert kind == "sinks"
    assert (out.double().cpu() - expected).abs().max() < tolerance
    for name, ours, theirs in zip("qkvs", low, full, strict=True):
        scale = max(1.0, theirs.grad.abs().max().item())
        assert (ours.grad.double().cpu() - theirs.grad).abs().max() < tolerance * 4 * scale, name


def test_sinks_at_a_realistic_size_on_the_cpu():
    _sinks_against_explicit("cpu", torch.float32, 1e-5, 100, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("documents", [False, True])
def test_sinks_on_the_gpu_equal_the_explicit_softmax(dtype, tolerance, window, documents):
    _sinks_against_explicit("cuda", dtype, tolerance, window, documents)
