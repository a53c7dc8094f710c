"""Ring attention: context parallelism's `--cp-comm-type p2p`.

Each CP rank holds two chunks of the sequence (parallel/context_parallel/chunks.py). Keys and values
travel around the ring of CP ranks, one chunk pair per step, the next transfer in flight while
the current pair is attended to; each pair's partial result is merged into the running one by
log-sum-exp (online softmax). Backward runs the ring again: the probabilities are recomputed
from the saved log-sum-exp (only this rank's q, k, v, output and log-sum-exp are kept), and
the key/value gradients travel with the chunks they belong to, each rank adding its part; one
more hop brings every chunk's gradient home. That transfer, too, is in flight while the next
pair is computed.

A pair is computed by quarters (this rank's two chunks against the sender's two): a quarter
no query sees is skipped (with load-balanced chunks half of every pair between two ranks), one
every query sees whole needs no mask, and the rest build their mask per tile of query rows,
so no temporary grows with the square of the sequence. Without a sliding window every
quarter is whole or causal, and runs through torch's fused attention kernels in the inputs'
dtype (parallel/context_parallel/blocks.py: memory-efficient on GPUs, flash on CPU), which
return the log-sum-exp the merge needs; masked quarters (a window) are plain matmuls in fp32
at least. Results are merged in fp32 at least.

With documents (`document_ids` [b, s] of the whole sequence, --reset-attention-mask) a quarter
whose query chunk shares no document with its key chunk in any sample is skipped as well, one
inside a single document in every sample stays whole or causal, and the others run each
document's rectangle through the same kernels (parallel/context_parallel/document_blocks.py;
with a window they add "same document" to their tile masks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.comm import group_rank, group_size
from parallel.context_parallel.blocks import block_kernels
from parallel.context_parallel.chunks import chunk_ids, visible
from parallel.context_parallel.document_blocks import (
    document_spans,
    rectangles,
    rectangles_backward,
    rectangles_forward,
)

# Scores computed at once: a quarter's queries are taken in tiles of rows so that its
# temporaries stay bounded (2**25 fp32 scores: 128 MiB) at any sequence length.
TILE_SCORES = 2**25


@dataclass(frozen=True)
class Quarter:
    """This rank's chunk `rows` (query positions from query_start) against the sender's
    chunk `cols` (key positions from key_start)."""

    rows: slice
    cols: slice
    query_start: int
    key_start: int
    full: bool  # every query sees every key
    by_document: bool = False  # the mask must say "same document" too


@dataclass(frozen=True)
class ChunkDocuments:
    """The first and last document of each of the 2C chunks in every sample (documents are
    numbered in order along a sample, so the two ends tell which documents a chunk holds)."""

    first: list[list[int]]  # [b][2C]
    last: list[list[int]]
    spans: list[list[tuple[int, int]]]  # each sample's documents: (start, end) positions

    @classmethod
    def of(cls, document_ids: torch.Tensor, cp_size: int) -> ChunkDocuments:
        b, s = document_ids.shape
        chunks = document_ids.reshape(b, 2 * cp_size, s // (2 * cp_size))
        spans = document_spans(document_ids)
        return cls(chunks[..., 0].tolist(), chunks[..., -1].tolist(), spans)

    def share(self, query_chunk: int, key_chunk: int) -> bool:
        """Whether some sample has a document in both chunks."""
        return any(
            last[key_chunk] >= first[query_chunk] and first[key_chunk] <= last[query_chunk]
            for first, last in zip(self.first, self.last, strict=True)
        )

    def single(self, query_chunk: int, key_chunk: int) -> bool:
        """Whether both chunks lie inside one document, in every sample."""
        return all(
            first[query_chunk] == last[query_chunk] == first[key_chunk] == last[key_chunk]
            for first, last in zip(self.first, self.last, strict=True)
        )


def quarters(
    cp_size: int,
    query_rank: int,
    key_rank: int,
    chunk: int,
    window: int | None,
    documents: ChunkDocuments | None = None,
) -> list[Quarter]:
    """The quarters of a pair in which some query sees some key."""
    out = []
    for i, query_chunk in enumerate(chunk_ids(cp_size, query_rank)):
        for j, key_chunk in enumerate(chunk_ids(cp_size, key_rank)):
            query_start, key_start = query_chunk * chunk, key_chunk * chunk
            farthest = query_start + chunk - 1 - key_start  # the largest query - key
            nearest = query_start - (key_start + chunk - 1)  # the smallest
            if farthest < 0 or (window is not None and nearest > window):
                continue
            if documents is not None and not documents.share(query_chunk, key_chunk):
                continue
            by_document = documents is not None and not documents.single(query_chunk, key_chunk)
            full = nearest >= 0 and (window is None or farthest <= window) and not by_document
            rows, cols = slice(i * chunk, (i + 1) * chunk), slice(j * chunk, (j + 1) * chunk)
            out.append(Quarter(rows, cols, query_start, key_start, full, by_document))
    return out


def _query_tiles(q: torch.Tensor, keys: int) -> list[slice]:
    b, h, sq, _ = q.shape
    rows = max(1, TILE_SCORES // (b * h * keys))
    return [slice(start, min(start + rows, sq)) for start in range(0, sq, rows)]


def _tile_mask(quarter: Quarter, rows: slice, keys: int, window, device, ids):
    """[rows, keys] (or [b, 1, rows, keys] by document) True where a query sees a key; None
    for a full quarter. `ids`: the whole sequence's document ids [b, s], or None."""
    if quarter.full:
        return None
    first = quarter.query_start + rows.start
    query_pos = torch.arange(first, first + rows.stop - rows.start, device=device)
    key_pos = torch.arange(quarter.key_start, quarter.key_start + keys, device=device)
    mask = visible(query_pos, key_pos, window)
    if not quarter.by_document:
        return mask
    same = ids[:, query_pos, None] == ids[:, None, key_pos]
    return (mask & same)[:, None]


def _scores(q, keys, mask, scale):
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def quarter_forward(q, keys, values, quarter, window, scale, ids=None):
    """(output, log-sum-exp) of queries q over one quarter's keys (expanded to q's heads)."""
    outs, lses = [], []
    for rows in _query_tiles(q, keys.shape[-2]):
        mask = _tile_mask(quarter, rows, keys.shape[-2], window, q.device, ids)
        scores = _scores(q[:, :, rows], keys, mask, scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
        outs.append(torch.matmul(probs, values))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def quarter_backward(q, keys, values, dout, lse, delta, quarter, window, scale, ids=None):
    """dq, dk, dv of one quarter (dk, dv per query head: the caller sums GQA groups)."""
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(keys), torch.zeros_like(values)
    for rows in _query_tiles(q, keys.shape[-2]):
        mask = _tile_mask(quarter, rows, keys.shape[-2], window, q.device, ids)
        qt, dot = q[:, :, rows], dout[:, :, rows]
        probs = torch.exp(_scores(qt, keys, mask, scale) - lse[:, :, rows, None])
        dv += torch.matmul(probs.transpose(-1, -2), dot)
        dprobs = torch.matmul(dot, values.transpose(-1, -2))
        dscores = probs * (dprobs - delta[:, :, rows, None]) * scale
        dq[:, :, rows] = torch.matmul(dscores, keys)
        dk += torch.matmul(dscores.transpose(-1, -2), qt)
    return dq, dk, dv


def _on_kernel(quarter: Quarter, window) -> bool:
    """Whether a quarter runs on the fused kernels: no window and no document mask, so whole
    or causal (the same chunk's queries and keys)."""
    if window is not None or quarter.by_document:
        return False
    return quarter.full or quarter.query_start == quarter.key_start


def _merge(out, lse, block_out, block_lse):
    """Combine two softmax-normalised partial results by their log-sum-exps."""
    total = torch.logaddexp(lse, block_lse)
    safe = total.masked_fill(total == float("-inf"), 0.0)
    kept, added = torch.exp(lse - safe)[..., None], torch.exp(block_lse - safe)[..., None]
    return out * kept + block_out * added, total


def repeat_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, g, s, d] -> [b, heads, s, d]: each key/value group serves heads / g query heads."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of repeat_groups for gradients: sum over the heads of a group."""
    b, h, s, d = x.shape
    return x if h == groups else x.view(b, groups, h // groups, s, d).sum(2)


class _Ring:
    """Send to the next CP rank and receive from the previous one, asynchronously."""

    def __init__(self, group):
        ranks = dist.get_process_group_ranks(group)
        me = group_rank(group)
        self.group = group
        self.next, self.prev = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]

    def shift(self, tensor: torch.Tensor):
        """Start passing `tensor` (contiguous, kept alive by the caller until the wait) on;
        returns (the buffer being received into, handles to wait on)."""
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group),
            dist.P2POp(dist.irecv, received, self.prev, self.group),
        ]
        return received, dist.batch_isend_irecv(ops)


def _wait(handles):
    for handle in handles:
        handle.wait()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Blocks are computed and merged in fp32 at least (bf16/fp16 inputs)."""
    return torch.promote_types(dtype, torch.float32)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, window, ids, documents, sink):
        cp_size, cp_rank = group_size(group), group_rank(group)
        ring, chunk, heads = _Ring(group), q.shape[-2] // 2, q.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        acc = _accumulation_dtype(q.dtype)
        if ids is not None and documents is None:
            documents = ChunkDocuments.of(ids, cp_size)
        masked = window is not None  # some quarters on matmuls
        qf = q.to(acc) if masked else None  # the matmul path's input
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kernels = block_kernels(q.device)
        kv = torch.stack([k, v])
        for step in range(cp_size):
            pending = ring.shift(kv) if step < cp_size - 1 else None
            source = (cp_rank - step) % cp_size
            raw_keys, raw_values = (repeat_groups(t, heads) for t in kv)
            if masked:
                keys, values = raw_keys.to(acc), raw_values.to(acc)
            for quarter in quarters(cp_size, cp_rank, source, chunk, window, documents):
                r, c = quarter.rows, quarter.cols
                if _on_kernel(quarter, window):
                    block_out, block_lse = kernels.forward(
                        q[:, :, r], raw_keys[:, :, c], raw_values[:, :, c], not quarter.full, scale
                    )
                    block = block_out.to(acc), block_lse.to(acc)
                elif quarter.by_document and window is None:  # documents' rectangles
                    parts = rectangles(
                        documents.spans, quarter.query_start, quarter.key_start, chunk
                    )
                    block = rectangles_forward(
                        kernels, q[:, :, r], raw_keys[:, :, c], raw_values[:, :, c], parts,
                        scale, acc,
                    )  # fmt: skip
                else:
                    block = quarter_forward(
                        qf[:, :, r], keys[:, :, c], values[:, :, c], quarter, window, scale, ids
                    )
                out[:, :, r], lse[:, :, r] = _merge(out[:, :, r], lse[:, :, r], *block)
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        if sink is not None:  # a sink logit per head: a "block" with no value (attention_sinks)
            sinks = sink.to(acc)[None, :, None].expand(lse.shape)
            out, lse = _merge(out, lse, torch.zeros_like(out), sinks)
        result = out.to(q.dtype)  # kept for backward in the activations' dtype, as flash does
        ctx.save_for_backward(q, k, v, result, lse, sink)
        ctx.group, ctx.window, ctx.scale = group, window, scale
        ctx.ids, ctx.documents = ids, documents
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        group, window, scale = ctx.group, ctx.window, ctx.scale
        ids, documents = ctx.ids, ctx.documents
        cp_size, cp_rank = group_size(group), group_rank(group)
        ring, chunk = _Ring(group), q.shape[-2] // 2
        heads, groups = q.shape[1], k.shape[1]
        acc = _accumulation_dtype(q.dtype)
        masked = window is not None
        if masked:  # the matmul path's inputs
            qf, doutf = q.to(acc), dout.to(acc)
            delta = (doutf * out.to(acc)).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kernels = block_kernels(q.device)
        kv = torch.stack([k, v])
        travelling = None  # (buffer, handles, tensor being sent) of the key/value gradients
        for step in range(cp_size):
            pending = ring.shift(kv) if step < cp_size - 1 else None
            source = (cp_rank - step) % cp_size
            raw_keys, raw_values = (repeat_groups(t, heads) for t in kv)
            if masked:
                keys, values = raw_keys.to(acc), raw_values.to(acc)
            mine = torch.zeros(kv.shape, dtype=acc, device=q.device)  # this rank's part
            for quarter in quarters(cp_size, cp_rank, source, chunk, window, documents):
                r, c = quarter.rows, quarter.cols
                if _on_kernel(quarter, window):
                    parts = kernels.backward(
                        dout[:, :, r], q[:, :, r], raw_keys[:, :, c], raw_values[:, :, c],
                        out[:, :, r], lse[:, :, r], not quarter.full, scale,
                    )  # fmt: skip
                    dq_part, dk_part, dv_part = (t.to(acc) for t in parts)
                elif quarter.by_document and window is None:  # documents' rectangles
                    parts = rectangles(
                        documents.spans, quarter.query_start, quarter.key_start, chunk
                    )
                    dq_part, dk_part, dv_part = rectangles_backward(
                        kernels, dout[:, :, r], q[:, :, r], raw_keys[:, :, c],
                        raw_values[:, :, c], out[:, :, r], lse[:, :, r], parts, scale, acc,
                    )  # fmt: skip
                else:
                    dq_part, dk_part, dv_part = quarter_backward(
                        qf[:, :, r], keys[:, :, c], values[:, :, c], doutf[:, :, r],
                        lse[:, :, r], delta[:, :, r], quarter, window, scale, ids,
                    )  # fmt: skip
                dq[:, :, r] += dq_part
                mine[0][:, :, c] += sum_groups(dk_part, groups)
                mine[1][:, :, c] += sum_groups(dv_part, groups)
            if travelling is not None:  # the other ranks' parts for this chunk pair
                _wait(travelling[1])
                mine += travelling[0]
            travelling = (*ring.shift(mine), mine)
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        _wait(travelling[1])  # after cp_size hops each chunk's gradient is back with its rank
        dkv = travelling[0]
        dsink = None
        if sink is not None:  # -sum over this rank's rows of p_sink x (dout . out)
            rows = (dout.to(acc) * out.to(acc)).sum(-1)
            dsink = -(torch.exp(sink.to(acc)[None, :, None] - lse) * rows).sum(dim=(0, 2))
            dsink = dsink.to(sink.dtype)
        dq, dk, dv = dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return dq, dk, dv, None, None, None, None, dsink


def ring_attention(
    q,
    k,
    v,
    group,
    window: int | None = None,
    document_ids: torch.Tensor | None = None,
    chunk_documents: ChunkDocuments | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence by ring exchange;
    q [b, heads, s_local, d], k and v [b, groups, s_local, d] (this rank's two chunks);
    `document_ids` [b, s]: the whole sequence's, to attend within documents (and
    `chunk_documents` where they are, if the caller has them already); `sink` [heads]: a
    logit per head beside every row's scores (attention sinks)."""
    return _RingAttention.apply(q, k, v, group, window, document_ids, chunk_documents, sink)
