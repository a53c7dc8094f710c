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
    # blocks no query shares a document with are skipped
    pairs = mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()
    causal_pairs = b * (s // 16) * (s // 16 + 1) // 2
    if kind == "tiny":
        assert pairs < causal_pairs
    if kind == "one" and window is None:
        assert pairs == causal_pairs
