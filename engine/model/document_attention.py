"""Attention that keeps to documents (--reset-attention-mask) without [s, s] masks.

A micro-batch's `Documents` holds each token's document index in its sample ([b, s],
non-decreasing along s: engine/data/documents.py) and makes, once for all layers, what the two
kernels need:

- "sdpa-documents" (the CPU, or attention dropout): every document of every sample is its own
  causal SDPA call over its slice of q, k and v, so the work is the sum of the documents'
  squares, not the sample's (no mask at all without a sliding window; with one, the window's
  mask of that document's length).
- "flex-documents" (CUDA without dropout): FlexAttention with a block mask computed per block
  of 128 tokens from the first and last document of each block: a block pair no query of which
  shares a document with a key is skipped, one inside a single document (and the window) runs
  without the mask function, the rest evaluate it. FlexAttention has no backward on the CPU,
  so there it is tested forward only (tests/test_document_attention.py).

Both equal the explicit mask (causal, same document, optionally within the window) in fp64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.context_parallel.document_blocks import document_spans
from parallel.context_parallel.ring import ChunkDocuments

FLEX_BLOCK = 128


class Documents:
    """The documents of a micro-batch's samples; `ids` [b, s] is the whole sequence's (under
    context parallelism too: parallel/context_parallel/ splits it where it needs)."""

    def __init__(self, ids: torch.Tensor):
        if ids.dim() != 2:
            raise ValueError(f"document ids must be [batch, sequence], not {list(ids.shape)}")
        self.ids = ids
        self._spans: list[list[tuple[int, int]]] | None = None
        self._block_masks: dict = {}
        self._chunks: dict = {}

    def spans(self) -> list[list[tuple[int, int]]]:
        """Each sample's documents as (start, end) token ranges, read once (one host sync)."""
        if self._spans is None:
            self._spans = document_spans(self.ids)
        return self._spans

    def chunks(self, cp_size: int) -> ChunkDocuments:
        """Where the documents are in the 2 x CP chunks of context parallelism (read once per
        micro-batch for every layer's ring attention, not by each)."""
        if cp_size not in self._chunks:
            self._chunks[cp_size] = ChunkDocuments.of(self.ids, cp_size)
        return self._chunks[cp_size]

    def block_mask(self, window: int | None):
        """FlexAttention's BlockMask of these documents (causal, same document, optionally
        within `window` tokens back), made once per window."""
        if window not in self._block_masks:
            self._block_masks[window] = document_block_mask(self.ids, window)
        return self._block_masks[window]


def allowed(ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The explicit [b, 1, s, s] mask (the reference the kernels are tested against)."""
    s = ids.shape[-1]
    positions = torch.arange(s, device=ids.device)
    back = positions[:, None] - positions[None, :]
    mask = (back >= 0) & (ids[:, :, None] == ids[:, None, :])
    if window is not None:
        mask &= back <= window
    return mask[:, None]


def attend_by_document(q, k, v, documents: Documents, window, dropout: float, grouped: bool):
    """softmax attention over [b, heads, s, d] within documents, one SDPA call per document."""
    kwargs = {"enable_gqa": True} if grouped else {}
    rows = []
    for sample, spans in enumerate(documents.spans()):
        parts = []
        for start, end in spans:
            qs, ks, vs = (t[sample : sample + 1, :, start:end] for t in (q, k, v))
            if window is not None and end - start > window + 1:
                length = end - start  # causal and at most `window` tokens back
                mask = torch.ones(length, length, dtype=torch.bool, device=q.device)
                mask = mask.tril().triu(-window)
                part = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, dropout_p=dropout, **kwargs
                )
            else:
                part = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, dropout_p=dropout, **kwargs
                )
            parts.append(part)
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]


def document_block_mask(ids: torch.Tensor, window: int | None, block: int = FLEX_BLOCK):
    """FlexAttention's BlockMask for document ids [b, s], from per-block document ranges."""
    from torch.nn.attention.flex_attention import BlockMask

    b, s = ids.shape
    blocks = -(-s // block)
    padded = torch.cat([ids, ids[:, -1:].expand(b, blocks * block - s)], dim=1)
    per_block = padded.view(b, blocks, block)
    first, last = per_block[..., 0], per_block[..., -1]  # non-decreasing: the ends suffice
    q_block = torch.arange(blocks, device=ids.device)[:, None]
    k_block = torch.arange(blocks, device=ids.device)[None, :]
    # block pairs where some query shares a document with some earlier key
    some = (k_block <= q_block) & (last[:, None, :] >= first[:, :, None])
    one_document = (first == last)[:, :, None] & (first == last)[:, None, :]
    whole = (k_block < q_block) & one_document & (first[:, :, None] == first[:, None, :])
    if window is not None:
        nearest = (q_block - k_block) * block - (block - 1)  # the smallest query - key
        farthest = (q_block - k_block) * block + (block - 1)
        some &= nearest <= window
        whole &= farthest <= window
    partial = some & ~whole

    def as_indices(pairs: torch.Tensor):
        counts = pairs.sum(-1).to(torch.int32)[:, None]  # [b, 1, q blocks]
        order = torch.argsort((~pairs).to(torch.int8), dim=-1, stable=True)
        return counts, order.to(torch.int32)[:, None]

    def inside(batch, head, query, key):
        same = ids[batch, query] == ids[batch, key]
        causal = query >= key
        if window is None:
            return same & causal
        return same & causal & (query - key <= window)

    partial_counts, partial_index = as_indices(partial)
    whole_counts, whole_index = as_indices(whole)
    return BlockMask.from_kv_blocks(
        partial_counts, partial_index, whole_counts, whole_index, block, inside, (s, s)
    )
