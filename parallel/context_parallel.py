"""Context parallelism (CP): each sample's sequence is split over the ranks of a CP group, and
attention, the only part of the model that mixes positions, exchanges keys and values.

Load balance: the sequence is cut into 2C chunks and CP rank r holds chunks r and 2C-1-r, so
every rank has the same causal work (an early chunk sees few keys, its partner many).

Three ways to attend over the whole sequence (Megatron-LM's `--cp-comm-type` names):

- `p2p` (ring attention): keys and values travel around the ring of CP ranks, one chunk per
  step, the next transfer in flight while the current block is computed; each block's partial
  result is merged by its log-sum-exp (online softmax). Backward runs the ring again, with the
  key/value gradients travelling beside the chunks they belong to, and recomputes each block's
  probabilities from the saved log-sum-exp, so only this rank's q, k, v, output and
  log-sum-exp are kept for backward. A block is computed by quarters (this rank's two chunks
  against the sender's two), skipping those the mask empties, in tiles of query rows.
- `a2a` (Ulysses): an all-to-all trades the sequence split for a head split, attention runs
  over the whole sequence for 1/C of the heads, and a second all-to-all trades back; heads and
  key/value groups must divide by C.
- `all_gather`: every rank gathers the whole sequence's keys and values (backward
  reduce-scatters their gradients) and attends with its own queries.

Masks are by global position: causal, optionally a sliding window (a token sees itself and
`window` tokens back, Hugging Face's Mistral mask).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.comm import gather_from_sequence_parallel_region, group_rank, group_size

COMM_TYPES = ("p2p", "a2a", "all_gather")


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of the 2 x cp_size chunks this rank holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_sequence(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's two load-balanced chunks of x along dim, in order."""
    if cp_size == 1:
        return x
    if x.shape[dim] % (2 * cp_size):
        raise ValueError(
            f"sequence length {x.shape[dim]} is not divisible by 2 x context-parallel size "
            f"{cp_size}"
        )
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = chunk_ids(cp_size, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def rank_positions(seq: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens this rank holds (seq: the whole sequence's length)."""
    return split_sequence(torch.arange(seq, device=device), 0, cp_size, cp_rank)


def visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[queries, keys] True where the query attends to the key: causal, within the window."""
    back = query_pos[:, None] - key_pos[None, :]
    mask = back >= 0
    if window is not None:
        mask &= back <= window
    return mask


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    comm_type: str = "p2p",
    window: int | None = None,
    attend=None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence; q, k, v are this
    rank's chunks, [b, heads, s_local, d] (k and v with fewer heads under GQA). `attend`
    (a2a only): attention over whole sequences in natural order, [b, h, s, d] -> same
    (default: causal, windowed, with GQA)."""
    if comm_type == "p2p":
        return _RingAttention.apply(q, k, v, group, window)
    if comm_type == "a2a":
        return _ulysses(q, k, v, group, window, attend)
    if comm_type == "all_gather":
        return _gathered(q, k, v, group, window)
    raise ValueError(f"unknown context-parallel comm type {comm_type!r}; one of {COMM_TYPES}")


# --- all_gather --------------------------------------------------------------------------


def _gathered(q, k, v, group, window):
    cp_size, cp_rank = group_size(group), group_rank(group)
    seq = q.shape[-2] * cp_size

    def gather(x: torch.Tensor) -> torch.Tensor:  # [b, h, s_local, d] -> [b, h, s, d]
        gathered = gather_from_sequence_parallel_region(x.permute(2, 0, 1, 3), group)
        return gathered.permute(1, 2, 0, 3)

    keys, values = gather(k), gather(v)
    query_pos = rank_positions(seq, cp_size, cp_rank, q.device)
    key_pos = torch.cat([rank_positions(seq, cp_size, r, q.device) for r in range(cp_size)])
    mask = visible(query_pos, key_pos, window)
    kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, **kwargs)


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

    out = (attend or _plain_attention(window))(whole(q), whole(k), whole(v))
    return _HeadsToSequence.apply(out.index_select(2, order), group)


def _plain_attention(window):
    def attend(q, k, v):
        kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        if window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        positions = torch.arange(q.shape[-2], device=q.device)
        mask = visible(positions, positions, window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)

    return attend


# --- p2p (ring) --------------------------------------------------------------------------


def _repeat_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, g, s, d] -> [b, heads, s, d]: each key/value group serves heads / g query heads."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of _repeat_groups for gradients: sum over the heads of a group."""
    b, h, s, d = x.shape
    return x if h == groups else x.view(b, groups, h // groups, s, d).sum(2)


# Scores computed at once: a block's queries are taken in tiles of rows so that its
# temporaries stay bounded (e.g. 128 MiB in fp32) at any sequence length.
TILE_SCORES = 2**25


def _query_tiles(q: torch.Tensor, keys: int) -> list[slice]:
    b, h, sq, _ = q.shape
    rows = max(1, TILE_SCORES // (b * h * keys))
    return [slice(start, min(start + rows, sq)) for start in range(0, sq, rows)]


def _block_scores(q, k, mask, scale):
    scores = torch.matmul(q, _repeat_groups(k, q.shape[1]).transpose(-1, -2)) * scale
    return scores.masked_fill(~mask, float("-inf"))


def _block_forward(q, k, v, mask, scale):
    """(output, log-sum-exp) of q over one block of keys; rows that see no key of the block
    get output 0 and log-sum-exp -inf."""
    outs, lses = [], []
    values = _repeat_groups(v, q.shape[1])
    for rows in _query_tiles(q, k.shape[-2]):
        scores = _block_scores(q[:, :, rows], k, mask[rows], scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
        outs.append(torch.matmul(probs, values))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _sub_blocks(mask: torch.Tensor) -> list[tuple[slice, slice]]:
    """The (query rows, key columns) quarters of a block, by the two chunks each side holds,
    that see anything: with load-balanced chunks a block between two ranks is half empty
    (and its own block a quarter), and empty quarters are not computed."""
    sq, sk = mask.shape
    halves_q = (slice(0, sq // 2), slice(sq // 2, sq))
    halves_k = (slice(0, sk // 2), slice(sk // 2, sk))
    return [(r, c) for r in halves_q for c in halves_k if bool(mask[r, c].any())]


def _merge(out, lse, block_out, block_lse):
    """Combine two softmax-normalised partial results by their log-sum-exps."""
    total = torch.logaddexp(lse, block_lse)
    safe = total.masked_fill(total == float("-inf"), 0.0)
    kept, added = torch.exp(lse - safe)[..., None], torch.exp(block_lse - safe)[..., None]
    return out * kept + block_out * added, total


def _block_backward(q, k, v, dout, lse, delta, mask, scale):
    """Gradients of one block: dq and the block's dk, dv (summed over GQA heads)."""
    heads, groups = q.shape[1], k.shape[1]
    keys, values = _repeat_groups(k, heads), _repeat_groups(v, heads)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(keys), torch.zeros_like(values)
    for rows in _query_tiles(q, k.shape[-2]):
        qt, dot = q[:, :, rows], dout[:, :, rows]
        probs = torch.exp(_block_scores(qt, k, mask[rows], scale) - lse[:, :, rows, None])
        dv += torch.matmul(probs.transpose(-1, -2), dot)
        dprobs = torch.matmul(dot, values.transpose(-1, -2))
        dscores = probs * (dprobs - delta[:, :, rows, None]) * scale
        dq[:, :, rows] = torch.matmul(dscores, keys)
        dk += torch.matmul(dscores.transpose(-1, -2), qt)
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)


class _Ring:
    """Send to the next CP rank and receive from the previous one, asynchronously."""

    def __init__(self, group):
        ranks = dist.get_process_group_ranks(group)
        me = group_rank(group)
        self.group = group
        self.next, self.prev = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]

    def shift(self, tensor: torch.Tensor):
        """Start passing `tensor` on; returns (received buffer, handles to wait on)."""
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor.contiguous(), self.next, self.group),
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
    def forward(ctx, q, k, v, group, window):
        cp_size, cp_rank = group_size(group), group_rank(group)
        ring = _Ring(group)
        seq = q.shape[-2] * cp_size
        scale = 1.0 / math.sqrt(q.shape[-1])
        query_pos = rank_positions(seq, cp_size, cp_rank, q.device)
        acc = _accumulation_dtype(q.dtype)
        qf = q.to(acc)
        out = torch.zeros(qf.shape, dtype=acc, device=q.device)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp_size):
            pending = ring.shift(kv) if step < cp_size - 1 else None
            source = (cp_rank - step) % cp_size
            mask = visible(query_pos, rank_positions(seq, cp_size, source, q.device), window)
            keys, values = kv[0].to(acc), kv[1].to(acc)
            for rows, cols in _sub_blocks(mask):
                block = _block_forward(
                    qf[:, :, rows], keys[:, :, cols], values[:, :, cols], mask[rows, cols], scale
                )
                out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], *block)
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        result = out.to(q.dtype)  # kept for backward in the activations' dtype, as flash does
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.window, ctx.scale = group, window, scale
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, window, scale = ctx.group, ctx.window, ctx.scale
        cp_size, cp_rank = group_size(group), group_rank(group)
        ring = _Ring(group)
        seq = q.shape[-2] * cp_size
        query_pos = rank_positions(seq, cp_size, cp_rank, q.device)
        acc = _accumulation_dtype(q.dtype)
        qf, doutf = q.to(acc), dout.to(acc)
        delta = (doutf * out.to(acc)).sum(-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        for step in range(cp_size):
            pending = ring.shift(kv) if step < cp_size - 1 else None
            source = (cp_rank - step) % cp_size
            mask = visible(query_pos, rank_positions(seq, cp_size, source, q.device), window)
            keys, values = kv[0].to(acc), kv[1].to(acc)
            for rows, cols in _sub_blocks(mask):
                grads = _block_backward(
                    qf[:, :, rows],
                    keys[:, :, cols],
                    values[:, :, cols],
                    doutf[:, :, rows],
                    lse[:, :, rows],
                    delta[:, :, rows],
                    mask[rows, cols],
                    scale,
                )
                dq[:, :, rows] += grads[0]
                dkv[0][:, :, cols] += grads[1]
                dkv[1][:, :, cols] += grads[2]
            # the chunk's gradient travels on with it; after the last step one more hop
            # brings every chunk's gradient home
            dkv, handles = ring.shift(dkv)
            _wait(handles)
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None
