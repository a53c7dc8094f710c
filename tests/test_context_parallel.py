"""Context-parallel attention (all-gather of keys and values, load-balanced chunks) against
one process's attention over the whole sequence: outputs and the gradients of q, k and v, on
2 and 4 gloo ranks, with grouped-query attention and with a sliding window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.context_parallel import (
    chunk_ids,
    context_parallel_attention,
    rank_positions,
    split_sequence,
)
from tests.distributed import rel_err, run_ranks

B, HEADS, GROUPS, SEQ, D = 2, 4, 2, 32, 8


def _inputs():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, SEQ, D, generator=generator, dtype=torch.float64)
    k = torch.randn(B, GROUPS, SEQ, D, generator=generator, dtype=torch.float64)
    v = torch.randn(B, GROUPS, SEQ, D, generator=generator, dtype=torch.float64)
    out_grad = torch.randn(B, HEADS, SEQ, D, generator=generator, dtype=torch.float64)
    return q, k, v, out_grad


def _reference(window):
    q, k, v, out_grad = _inputs()
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    positions = torch.arange(SEQ)
    back = positions[:, None] - positions[None, :]
    mask = (back >= 0) & (back <= window) if window is not None else back >= 0
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.backward(out_grad)
    return out.detach(), q.grad, k.grad, v.grad


def _context_parallel(rank, world, window):
    import torch.distributed as dist

    group = dist.group.WORLD
    q, k, v, out_grad = _inputs()
    mine = [split_sequence(t, 2, world, rank).clone().requires_grad_(True) for t in (q, k, v)]
    out = context_parallel_attention(*mine, group, window=window, enable_gqa=True)
    out.backward(split_sequence(out_grad, 2, world, rank))
    return out.detach(), *(t.grad for t in mine)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_matches_one_process(world, window):
    expected = _reference(window)
    for rank, got in enumerate(run_ranks(_context_parallel, world, window)):
        for name, mine, full in zip(("out", "dq", "dk", "dv"), got, expected):
            want = split_sequence(full, 2, world, rank)
            assert rel_err(mine, want) < 1e-10, (rank, name, rel_err(mine, want))


def test_load_balanced_chunks():
    assert [chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert rank_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert rank_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="not divisible by 2 x context-parallel size 2"):
        split_sequence(torch.zeros(6), 0, 2, 0)
