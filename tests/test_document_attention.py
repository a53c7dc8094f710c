"""Attention within documents (engine/model/document_attention.py) equals SDPA with the
explicit mask (causal, same document, optionally a window) in fp64, for forward and backward,
on the document layouts that break things: one document, many tiny ones, a document ending at
the last token (the next one empty), documents longer than the window."""

import pytest
import torch
import torch.nn.functional as F

from engine.data.documents import document_layout
from engine.model.attention_kernel import AttentionKernel, AttentionMasks
from engine.model.document_attention import Documents, allowed, document_block_mask

EOD = 0


def _tokens(kind: str, b: int, s: int, gen: torch.Generator) -> torch.Tensor:
    tokens = torch.randint(1, 50, (b, s), generator=gen)
    if kind == "one":
        return tokens
    if kind == "tiny":  # documents of 1 to 4 tokens, EOD after EOD included
        for row in tokens:
            at = 0
            while at < s:
                at += int(torch.randint(0, 4, (1,), generator=gen))
                if at < s:
                    row[at] = EOD
                at += 1
        return tokens
    if kind == "ends-at-last":  # the last token ends a document: the next one is empty
        tokens[:, s // 3] = EOD
        tokens[:, -1] = EOD
        return tokens
    if kind == "mixed":  # a few documents of random lengths, each sample its own
        for row in tokens:
            for at in torch.randint(0, s, (3,), generator=gen).tolist():
                row[at] = EOD
        return tokens
    raise ValueError(kind)


def _reference(q, k, v, ids, window):
    mask = allowed(ids, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("kind", ["one", "tiny", "ends-at-last", "mixed"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("groups", [4, 2])
def test_sdpa_documents_equal_explicit_mask(kind, window, groups):
    gen = torch.Generator().manual_seed(hash((kind, window, groups)) % 2**31)
    b, heads, s, d = 2, 4, 48, 8
    tokens = _tokens(kind, b, s, gen)
    ids = document_layout(tokens, EOD, reset_attention_mask=True).document_ids
    q = torch.randn(b, heads, s, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, groups, s, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, groups, s, d, generator=gen, dtype=torch.float64, requires_grad=True)
    kernel = AttentionKernel(
        "sdpa-causal", window, groups != heads, AttentionMasks(), "sdpa-documents"
    )
    out = kernel(q, k, v, 0.0, Documents(ids))
    expected = _reference(q, k, v, ids, window)
    assert (out - expected).abs().max() < 1e-12
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for a, e in zip(got, want, strict=True):
        assert (a - e).abs().max() < 1e-12
    if window is None:  # the documents matter: whole-sample attention differs with several
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        several = bool((ids[:, -1] > 0).any())
        assert several == bool((whole - expected).abs().max() > 1e-6)


def _listed(counts, indices, shape) -> torch.Tensor:
    """[b, query blocks, key blocks] True where a BlockMask's table lists the pair."""
    listed = torch.zeros(shape, dtype=torch.bool)
    for sample in range(shape[0]):
        for row in range(shape[1]):
            listed[sample, row, indices[sample, 0, row, : counts[sample, 0, row]].long()] = True
    return listed


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
@pytest.mark.parametrize("kind", ["one", "tiny", "mixed"])
@pytest.mark.parametrize("window", [None, 150])
def test_flex_block_mask_equals_explicit_mask_forward(kind, window):
    """FlexAttention has no backward on the CPU: its block mask is checked forward here (and on
    a GPU by tools/gpu_check.py). Blocks of 16 tokens so that a 96-token sample has several."""
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(7)
    b, heads, s, d = 2, 2, 96, 8
    tokens = _tokens(kind, b, s, gen)
    if kind == "mixed":
        tokens[0, 10] = tokens[0, 70] = EOD  # a document across several blocks
    ids = document_layout(tokens, EOD, reset_attention_mask=True).document_ids
    window = None if window is None else window // 10
    q, k, v = (torch.randn(b, heads, s, d, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = document_block_mask(ids, window, block=16)
    out = flex_attention(q, k, v, block_mask=mask)
    expected = _reference(q, k, v, ids, window)
    assert (out - expected).abs().max() < 1e-10
    # the block tables themselves (the CPU's eager FlexAttention applies the mask function to
    # every pair, whatever the tables say): every block pair holding an allowed pair is listed,
    # once, and those listed as whole hold only allowed pairs
    dense = allowed(ids, window)[:, 0].reshape(b, s // 16, 16, s // 16, 16)
    some, every = dense.any(4).any(2), dense.all(4).all(2)
    partial = _listed(mask.kv_num_blocks, mask.kv_indices, some.shape)
    whole = _listed(mask.full_kv_num_blocks, mask.full_kv_indices, some.shape)
    assert not (partial & whole).any()
    assert torch.equal(partial | whole, some)
    assert not (whole & ~every).any()
    # blocks no query shares a document with are skipped
    pairs = mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()
    causal_pairs = b * (s // 16) * (s // 16 + 1) // 2
    if kind == "tiny":
        assert pairs < causal_pairs
    if kind == "one" and window is None:
        assert pairs == causal_pairs


def _rectangles_against_matmuls(device: str, dtype: torch.dtype, tolerance: float):
    """A ring quarter within documents through the block kernels, one call per document's
    rectangle (parallel/context_parallel/document_blocks.py), against ring.py's fp32 matmul
    path with the explicit mask: forward and backward, a causal (same chunk) quarter and a
    whole one (an earlier key chunk)."""
    import math

    from parallel.context_parallel import ring
    from parallel.context_parallel.blocks import block_kernels
    from parallel.context_parallel.document_blocks import (
        document_spans,
        rectangles,
        rectangles_backward,
        rectangles_forward,
    )

    gen = torch.Generator().manual_seed(3)
    b, heads, chunk, d = 2, 4, 64, 32
    tokens = _tokens("mixed", b, 4 * chunk, gen)
    ids = document_layout(tokens, EOD, reset_attention_mask=True).document_ids.to(device)
    spans = document_spans(ids)
    kernels, scale = block_kernels(torch.device(device)), 1 / math.sqrt(d)
    q, k, v, dout = (torch.randn(b, heads, chunk, d, generator=gen).to(device) for _ in range(4))
    for query_start, key_start in ((2 * chunk, 2 * chunk), (3 * chunk, chunk)):
        quarter = ring.Quarter(
            slice(0, chunk), slice(0, chunk), query_start, key_start, False, True
        )
        out, lse = ring.quarter_forward(q, k, v, quarter, None, scale, ids)
        parts = rectangles(spans, query_start, key_start, chunk)
        low = [t.to(dtype) for t in (q, k, v, dout)]
        got_out, got_lse = rectangles_forward(kernels, *low[:3], parts, scale, torch.float32)
        rows = lse > float("-inf")
        assert torch.equal(rows, got_lse > float("-inf"))
        assert (got_out - out).abs().max() < tolerance
        assert (got_lse[rows] - lse[rows]).abs().max() < tolerance
        delta = (dout * out).sum(-1)
        lse = lse.masked_fill(~rows, 0.0)  # rows seeing no key here (the ring's merged is finite)
        expected = ring.quarter_backward(q, k, v, dout, lse, delta, quarter, None, scale, ids)
        grads = rectangles_backward(
            kernels, low[3], *low[:3], out.to(dtype), lse, parts, scale, torch.float32
        )
        for ours, theirs in zip(grads, expected, strict=True):
            assert (ours - theirs).abs().max() < tolerance * 4


def test_ring_rectangles_within_documents_on_the_cpu_kernels():
    _rectangles_against_matmuls("cpu", torch.float32, 1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_ring_rectangles_within_documents_on_the_gpu_kernels(dtype, tolerance):
    _rectangles_against_matmuls("cuda", dtype, tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 100])
def test_flex_documents_on_the_gpu_equal_the_explicit_mask(dtype, tolerance, window):
    """The CUDA kernel of --reset-attention-mask (compiled FlexAttention, block mask from the
    documents), forward and backward, GQA, against SDPA with the explicit mask in fp64 (CPU)."""
    gen = torch.Generator().manual_seed(11)
    b, heads, groups, s, d = 2, 8, 2, 512, 64
    ids = document_layout(_tokens("mixed", b, s, gen), EOD, reset_attention_mask=True)
    ids = ids.document_ids.cuda()
    inputs = [torch.randn(b, n, s, d, generator=gen).cuda() for n in (heads, groups, groups)]
    grad = torch.randn(b, heads, s, d, generator=gen).cuda()
    kernel = AttentionKernel("sdpa-causal", window, True, AttentionMasks(), "flex-documents")
    low = [t.to(dtype).requires_grad_() for t in inputs]
    out = kernel(*low, 0.0, Documents(ids))
    out.backward(grad.to(dtype))
    full = [t.detach().double().cpu().requires_grad_() for t in inputs]
    expected = _reference(*full, ids.cpu(), window)
    expected.backward(grad.double().cpu())
    precision = torch.get_float32_matmul_precision()
    error = (out.double().cpu() - expected).abs().max().item()
    assert error < tolerance, (error, precision)
    for name, ours, theirs in zip("qkv", low, full, strict=True):
        error = (ours.grad.double().cpu() - theirs.grad).abs().max().item()
        assert error < tolerance * 4, (name, error, precision)
