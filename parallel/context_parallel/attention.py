"""Context parallelism (CP): each sample's sequence is split over the ranks of a CP group, and
attention, the only part of the model that mixes positions, exchanges keys and values.

Load balance: the sequence is cut into 2C chunks and CP rank r holds chunks r and 2C-1-r, so
every rank has the same causal work (an early chunk sees few keys, its partner many).

Three ways to attend over the whole sequence (Megatron-LM's `--cp-comm-type` names):

- `p2p` (ring attention, parallel/context_parallel/ring.py): keys and values travel around the ring
  of CP ranks, one chunk pair per step, and partial results are merged by log-sum-exp.
- `a2a` (Ulysses): an all-to-all trades the sequence split for a head split, attention runs
  over the whole sequence for 1/C of the heads, and a second all-to-all trades back; heads and
  key/value groups must divide by C.
- `allgather`: every rank gathers the whole sequence's keys and values (backward
  reduce-scatters their gradients) and attends with its own queries.

Masks are by global position: causal, optionally a sliding window (a token sees itself and
`window` tokens back, Hugging Face's Mistral mask), and, given `document_ids` [b, s] (the
whole sequence's: every CP rank keeps them whole), within documents. allgather builds that
mask as a [queries, keys] boolean tensor ([b, 1, queries, keys] by document); a2a attends over
whole sequences with `attend` (the model's kernel, which knows the documents) or that mask; the
ring builds it per tile and skips chunk pairs that share no document.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.comm import group_rank, group_size
from parallel.context_parallel.chunks import chunk_ids, rank_positions, split_sequence, visible
from parallel.context_parallel.ring import ring_attention
from parallel.tensor_parallel.regions import gather_from_sequence_parallel_region

__all__ = [
    "COMM_TYPES",
    "chunk_ids",
    "context_parallel_attention",
    "rank_positions",
    "split_sequence",
    "visible",
]

COMM_TYPES = ("p2p", "a2a", "allgather")


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    comm_type: str = "p2p",
    window: int | None = None,
    attend=None,
    document_ids: torch.Tensor | None = None,
    chunk_documents=None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence; q, k, v are this
    rank's chunks, [b, heads, s_local, d] (k and v with fewer heads under GQA). `attend`
    (a2a only): attention over whole sequences in natural order, [b, h, s, d] -> same
    (default: causal, windowed, within documents, with GQA). `document_ids` [b, s]: each
    token's document, the whole sequence's (p2p: `chunk_documents`, ring.ChunkDocuments of
    them, when the caller keeps one for every layer). `sink` [heads]: a logit per head beside
    every row's scores (attention sinks; p2p and allgather: under a2a, `attend` applies the
    sinks of the heads it is given)."""
    if comm_type == "p2p":
        return ring_attention(q, k, v, group, window, document_ids, chunk_documents, sink)
    if sink is not None and comm_type != "allgather":
        raise ValueError(f"--cp-comm-type {comm_type}: attention sinks run with p2p or allgather")
    if comm_type == "a2a":
        return _ulysses(q, k, v, group, window, attend or _plain_attention(window, document_ids))
    if comm_type == "allgather":
        return _gathered(q, k, v, group, window, document_ids, sink)
    raise ValueError(f"unknown context-parallel comm type {comm_type!r}; one of {COMM_TYPES}")


# --- allgather ---------------------------------------------------------------------------


def _gathered(q, k, v, group, window, ids, sink=None):
    cp_size, cp_rank = group_size(group), group_rank(group)
    seq = q.shape[-2] * cp_size

    def gather(x: torch.Tensor) -> torch.Tensor:  # [b, h, s_local, d] -> [b, h, s, d]
        gathered = gather_from_sequence_parallel_region(x.permute(2, 0, 1, 3), group)
        return gathered.permute(1, 2, 0, 3)

    keys, values = gather(k), gather(v)
    query_pos = rank_positions(seq, cp_size, cp_rank, q.device)
    key_pos = torch.cat([rank_positions(seq, cp_size, r, q.device) for r in range(cp_size)])
    mask = visible(query_pos, key_pos, window)
    if ids is not None:
        mask = (mask & (ids[:, query_pos, None] == ids[:, None, key_pos]))[:, None]
    kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if sink is not None:
        return _with_sink(q, keys, values, mask, sink)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, **kwargs)


def _with_sink(q, keys, values, mask, sink):
    """Masked attention with a sink logit per head beside every row's scores (the scores of
    this rank's queries against the whole sequence, as the all-gather's mask already is)."""
    heads = q.shape[1]
    keys = keys.repeat_interleave(heads // keys.shape[1], dim=1)
    values = values.repeat_interleave(heads // values.shape[1], dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    sinks = sink.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1, dtype=torch.float32)
    probs = probs[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


# --- a2a (Ulysses) -----------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x [C, ...]: piece i goes to CP rank i; returns [C, ...] with rank i's piece at i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h, s_local, d] -> [b, h / C, C x s_local, d] (sequence in CP-rank order)."""
    c = group_size(group)
    b, h, s, d = x.shape
    pieces = x.reshape(b, c, h // c, s, d).transpose(0, 1)
    return _all_to_all(pieces, group).permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)


def _heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of _sequence_to_heads."""
    c = group_size(group)
    b, hc, cs, d = x.shape
    pieces = x.reshape(b, hc, c, cs // c, d).permute(2, 0, 1, 3, 4)
    return _all_to_all(pieces, group).transpose(0, 1).reshape(b, c * hc, cs // c, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group), None


def _ulysses(q, k, v, group, window, attend):
    cp_size = group_size(group)
    for name, x in (("attention heads", q), ("key/value groups", k)):
        if x.shape[1] % cp_size:
            raise ValueError(
                f"--cp-comm-type a2a: {x.shape[1]} {name} per tensor-parallel rank do not "
                f"divide by context-parallel size {cp_size}"
            )
    seq = q.shape[-2] * cp_size
    order = torch.cat([rank_positions(seq, cp_size, r, q.device) for r in range(cp_size)])
    natural = torch.argsort(order)  # gathered index of each position

    def whole(x):
        return _SequenceToHeads.apply(x, group).index_select(2, natural)

    out = attend(whole(q), whole(k), whole(v))
    return _HeadsToSequence.apply(out.index_select(2, order), group)


def _plain_attention(window, ids):
    def attend(q, k, v):
        kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        if window is None and ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        positions = torch.arange(q.shape[-2], device=q.device)
        mask = visible(positions, positions, window)
        if ids is not None:
            mask = (mask & (ids[:, :, None] == ids[:, None, :]))[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)

    return attend
