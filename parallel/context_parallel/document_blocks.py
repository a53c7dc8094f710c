"""Ring attention's chunk pairs within documents on the fused block kernels.

Inside a quarter (a query chunk against a key chunk, parallel/context_parallel/ring.py), the
pairs a document allows are one rectangle per document present in both chunks: that
document's queries against its keys, whole when the key chunk comes before the query chunk,
causal when they are the same chunk. Every query belongs to one document, so each query row
gets at most one rectangle: the quarter's output and log-sum-exp are the rectangles', and rows
whose document has no key in the chunk keep a log-sum-exp of -inf (nothing to merge). Each
rectangle is one call of the block kernels (parallel/context_parallel/blocks.py), so the work
is the documents', not the chunks' squares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def document_spans(ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Each sample's documents as (start, end) positions, from ids [b, s] (non-decreasing
    along s), read once on the host."""
    spans = []
    for row in ids.cpu():
        _, counts = torch.unique_consecutive(row, return_counts=True)
        ends = torch.cumsum(counts, 0).tolist()
        spans.append(list(zip([0, *ends[:-1]], ends, strict=True)))
    return spans


@dataclass(frozen=True)
class Rectangle:
    """One document's queries (`rows`, within the quarter's) against its keys (`cols`)."""

    sample: int
    rows: slice
    cols: slice
    causal: bool


def rectangles(
    spans: list[list[tuple[int, int]]], query_start: int, key_start: int, chunk: int
) -> list[Rectangle]:
    """The rectangles of the quarter whose chunks start at these positions (the key chunk at
    or before the query chunk)."""
    out = []
    for sample, documents in enumerate(spans):
        for start, end in documents:
            rows = (max(start, query_start), min(end, query_start + chunk))
            cols = (max(start, key_start), min(end, key_start + chunk))
            if rows[0] >= rows[1] or cols[0] >= cols[1]:
                continue
            out.append(
                Rectangle(
                    sample,
                    slice(rows[0] - query_start, rows[1] - query_start),
                    slice(cols[0] - key_start, cols[1] - key_start),
                    causal=query_start == key_start,
                )
            )
    return out


def rectangles_forward(kernels, q, keys, values, blocks: list[Rectangle], scale, acc):
    """(output, log-sum-exp) of a quarter's queries q [b, h, rows, d] over its keys and values
    [b, h, cols, d] (expanded to q's heads), in the accumulation dtype `acc`."""
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    for block in blocks:
        s, r, c = slice(block.sample, block.sample + 1), block.rows, block.cols
        part_out, part_lse = kernels.forward(
            q[s, :, r], keys[s, :, c], values[s, :, c], block.causal, scale
        )
        out[s, :, r], lse[s, :, r] = part_out.to(acc), part_lse.to(acc)
    return out, lse


def rectangles_backward(kernels, dout, q, keys, values, out, lse, blocks, scale, acc):
    """dq, dk, dv of a quarter (dk, dv per query head), given the rows' merged output and
    log-sum-exp."""
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(keys.shape, dtype=acc, device=q.device)
    dv = torch.zeros(values.shape, dtype=acc, device=q.device)
    for block in blocks:
        s, r, c = slice(block.sample, block.sample + 1), block.rows, block.cols
        parts = kernels.backward(
            dout[s, :, r], q[s, :, r], keys[s, :, c], values[s, :, c],
            out[s, :, r], lse[s, :, r], block.causal, scale,
        )  # fmt: skip
        dq[s, :, r] += parts[0].to(acc)
        dk[s, :, c] += parts[1].to(acc)
        dv[s, :, c] += parts[2].to(acc)
    return dq, dk, dv
