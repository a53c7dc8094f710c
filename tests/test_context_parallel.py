"""Context-parallel attention (ring, all-to-all and all-gather; load-balanced chunks) against
one process's attention over the whole sequence: outputs and the gradients of q, k and v, on
2 and 4 gloo ranks, with grouped-query attention and with a sliding window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.context_parallel.attention import (
    COMM_TYPES,
    chunk_ids,
    context_parallel_attention,
    rank_positions,
    split_sequence,
    visible,
)
from parallel.context_parallel.ring import ChunkDocuments, quarters
from tests.distributed import rel_err, run_ranks

B, HEADS, GROUPS, SEQ, D = 2, 8, 4, 32, 8
WINDOWS = (None, 5, 13)
DOCUMENTS = (False, True)


def _document_ids() -> torch.Tensor:
    """Sample 0: documents across the chunk boundaries (of 2 and 4 ranks); sample 1: short
    documents, the last one ending at the last token."""
    from engine.data.documents import document_layout

    tokens = torch.ones(B, SEQ, dtype=torch.long)
    tokens[0, [5, 6, 20]] = 0
    tokens[1, 2::3] = 0
    tokens[1, -1] = 0
    return document_layout(tokens, 0, reset_attention_mask=True).document_ids


def _inputs():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, SEQ, D, generator=generator, dtype=torch.float64)
    k = torch.randn(B, GROUPS, SEQ, D, generator=generator, dtype=torch.float64)
    v = torch.randn(B, GROUPS, SEQ, D, generator=generator, dtype=torch.float64)
    out_grad = torch.randn(B, HEADS, SEQ, D, generator=generator, dtype=torch.float64)
    return q, k, v, out_grad


def _reference(window, documents=False):
    q, k, v, out_grad = _inputs()
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    positions = torch.arange(SEQ)
    back = positions[:, None] - positions[None, :]
    mask = (back >= 0) & (back <= window) if window is not None else back >= 0
    if documents:
        ids = _document_ids()
        mask = (mask & (ids[:, :, None] == ids[:, None, :]))[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.backward(out_grad)
    return out.detach(), q.grad, k.grad, v.grad


def _context_parallel(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    q, k, v, out_grad = _inputs()
    results = {}
    for comm_type in COMM_TYPES:
        for window in WINDOWS:
            for documents in DOCUMENTS:
                ids = _document_ids() if documents else None
                mine = [
                    split_sequence(t, 2, world, rank).clone().requires_grad_(True)
                    for t in (q, k, v)
                ]
                out = context_parallel_attention(*mine, group, comm_type, window, document_ids=ids)
                out.backward(split_sequence(out_grad, 2, world, rank))
                results[comm_type, window, documents] = (out.detach(), *(t.grad for t in mine))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_matches_one_process(world):
    """Each comm type, with windows and documents (--reset-attention-mask), in fp64."""
    expected = {(w, d): _reference(w, d) for w in WINDOWS for d in DOCUMENTS}
    for rank, results in enumerate(run_ranks(_context_parallel, world)):
        assert set(results) == {(c, *key) for c in COMM_TYPES for key in expected}
        for (comm_type, window, documents), got in results.items():
            for name, mine, full in zip(
                ("out", "dq", "dk", "dv"), got, expected[window, documents], strict=True
            ):
                want = split_sequence(full, 2, world, rank)
                err = rel_err(mine, want)
                assert err < 1e-10, (comm_type, window, documents, rank, name, err)


def _ring_in_tiles(rank, world):
    """The ring with one query row per tile (as a long sequence would take it)."""
    import torch.distributed as dist

    import parallel.context_parallel.ring as ring

    ring.TILE_SCORES = 1
    q, k, v, out_grad = _inputs()
    mine = [split_sequence(t, 2, world, rank).clone().requires_grad_(True) for t in (q, k, v)]
    out = context_parallel_attention(*mine, dist.group.WORLD, "p2p", 5)
    out.backward(split_sequence(out_grad, 2, world, rank))
    return out.detach(), *(t.grad for t in mine)


def test_ring_attention_in_query_tiles_matches_one_process():
    expected = _reference(5)
    for rank, got in enumerate(run_ranks(_ring_in_tiles, 2)):
        for name, mine, full in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
            err = rel_err(mine, split_sequence(full, 2, 2, rank))
            assert err < 1e-10, (rank, name, err)


def _ulysses_heads_must_divide(rank, world):
    import torch.distributed as dist

    q = torch.zeros(1, 2, 8, 4)
    k = torch.zeros(1, 1, 8, 4)
    try:
        context_parallel_attention(q, k, k, dist.group.WORLD, "a2a")
    except ValueError as error:
        return str(error)
    return None


def test_all_to_all_needs_heads_divisible_by_cp():
    messages = run_ranks(_ulysses_heads_must_divide, 2)
    assert messages[0] == (
        "--cp-comm-type a2a: 1 key/value groups per tensor-parallel rank do not divide by "
        "context-parallel size 2"
    )


@pytest.mark.parametrize("window", [None, 0, 3, 9, 40])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_quarters_are_exactly_the_visible_ones(cp, window):
    """Every quarter of every pair the ring computes: skipped only where the mask is empty,
    unmasked only where it is full, against the mask of global positions."""
    chunk = 5
    seq = 2 * cp * chunk
    for query_rank in range(cp):
        for key_rank in range(cp):
            mask = visible(
                rank_positions(seq, cp, query_rank), rank_positions(seq, cp, key_rank), window
            )
            kept = {
                (q.rows.start, q.cols.start): q
                for q in quarters(cp, query_rank, key_rank, chunk, window)
            }
            for rows in (slice(0, chunk), slice(chunk, 2 * chunk)):
                for cols in (slice(0, chunk), slice(chunk, 2 * chunk)):
                    part = mask[rows, cols]
                    quarter = kept.get((rows.start, cols.start))
                    assert (quarter is not None) == bool(part.any())
                    if quarter is not None:
                        assert quarter.full == bool(part.all())
                        assert quarter.query_start == rank_positions(seq, cp, query_rank)[rows][0]
                        assert quarter.key_start == rank_positions(seq, cp, key_rank)[cols][0]


@pytest.mark.parametrize("layout", ["one", "boundaries", "tiny", "long-then-short"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_quarters_with_documents_skip_exactly_the_pairs_without_a_shared_document(cp, layout):
    """With documents, a quarter is computed only where some query sees some key of its own
    document (in some sample), without a mask only where every query sees every key; the
    quarters skipped for the documents are counted against the causal ring's."""
    from engine.data.documents import document_layout

    chunk = 6
    seq = 2 * cp * chunk
    tokens = torch.ones(2, seq, dtype=torch.long)
    if layout == "boundaries":  # documents ending exactly at chunk boundaries
        tokens[:, chunk - 1 :: chunk] = 0
    elif layout == "tiny":
        tokens[:, ::2] = 0
    elif layout == "long-then-short":  # sample 0: one long document; sample 1: short ones
        tokens[1, 3::5] = 0
    ids = document_layout(tokens, 0, reset_attention_mask=True).document_ids
    documents = ChunkDocuments.of(ids, cp)
    computed = causal = 0
    for query_rank in range(cp):
        for key_rank in range(cp):
            query_pos = rank_positions(seq, cp, query_rank)
            key_pos = rank_positions(seq, cp, key_rank)
            same = ids[:, query_pos, None] == ids[:, None, key_pos]
            mask = visible(query_pos, key_pos, None) & same  # [b, queries, keys]
            kept = {
                (q.rows.start, q.cols.start): q
                for q in quarters(cp, query_rank, key_rank, chunk, None, documents)
            }
            computed += len(kept)
            causal += len(quarters(cp, query_rank, key_rank, chunk, None))
            for rows in (slice(0, chunk), slice(chunk, 2 * chunk)):
                for cols in (slice(0, chunk), slice(chunk, 2 * chunk)):
                    part = mask[:, rows, cols]
                    quarter = kept.get((rows.start, cols.start))
                    assert (quarter is not None) == bool(part.any())
                    if quarter is not None:
                        assert quarter.full == bool(part.all())
                        if not quarter.by_document:  # then the documents remove nothing
                            causal_part = visible(query_pos, key_pos, None)[rows, cols]
                            assert bool((part == causal_part).all())
    if layout in ("one", "long-then-short"):  # sample 0 is one document: nothing skipped
        assert computed == causal
    else:
        assert computed < causal


def test_load_balanced_chunks():
    assert [chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert rank_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert rank_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="not divisible by 2 x context-parallel size 2"):
        split_sequence(torch.zeros(6), 0, 2, 0)


def _blocks_against_matmuls(device: str, dtype: torch.dtype, tolerance: float):
    """Item 11 of the GPU-readiness issue: a whole and a causal block through the fused
    kernels (parallel/context_parallel/blocks.py) against ring.py's fp32 matmul blocks, forward
    (output, log-sum-exp) and backward (given the row's output and log-sum-exp)."""
    import math

    from parallel.context_parallel import ring
    from parallel.context_parallel.blocks import block_kernels

    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (
        torch.randn(2, 4, 64, 64, device=device, generator=generator) for _ in range(4)
    )
    scale, kernels = 1 / math.sqrt(64), block_kernels(torch.device(device))
    for full in (True, False):
        quarter = ring.Quarter(slice(0, 64), slice(0, 64), 128 if full else 0, 0, full)
        out, lse = ring.quarter_forward(q, k, v, quarter, None, scale)
        low = [t.to(dtype) for t in (q, k, v, dout)]
        fused_out, fused_lse = kernels.forward(*low[:3], not full, scale)
        assert fused_lse.dtype == torch.float32 and fused_lse.shape == lse.shape
        assert (fused_out.float() - out).abs().max() < tolerance
        assert (fused_lse - lse).abs().max() < tolerance
        delta = (dout * out).sum(-1)
        expected = ring.quarter_backward(q, k, v, dout, lse, delta, quarter, None, scale)
        # as ring.py passes them: the row's merged output (not the kernel's own) and slices
        rows = [torch.cat([t, t], 2)[:, :, 64:] for t in (*low, out.to(dtype))]
        grads = kernels.backward(rows[3], *rows[:3], rows[4], lse, not full, scale)
        for ours, theirs in zip(grads, expected, strict=True):
            assert (ours.float() - theirs).abs().max() < tolerance * 4, full


def test_ring_blocks_run_on_the_fused_kernels_with_a_window_on_matmuls():
    _blocks_against_matmuls("cpu", torch.float32, 1e-5)
    from parallel.context_parallel.ring import _on_kernel, quarters

    for window in (None, 8):
        for quarter in quarters(2, 0, 0, 16, window) + quarters(2, 1, 0, 16, window):
            assert _on_kernel(quarter, window) == (window is None), quarter


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_ring_blocks_on_the_gpu_kernels(dtype, tolerance):
    _blocks_against_matmuls("cuda", dtype, tolerance)
