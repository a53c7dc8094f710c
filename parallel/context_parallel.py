"""Context parallelism's attention, all-gather variant (Megatron-LM's `--cp-comm-type
all_gather`): the building block, tested on its own; `--context-parallel-size` above 1 is still
refused at start until the rest of the dimension (the CP process group, splitting batches,
positions and RoPE per chunk, the loss over the split sequence, gradients over DP x CP) is
wired in.

Load balance: the sequence is cut into 2C chunks and CP rank r holds chunks r and 2C-1-r, so
every rank has the same causal work (an early chunk sees few keys, its partner many).

Attention: each rank all-gathers the keys and values of the whole sequence (backward
reduce-scatters their gradients, so each rank gets the sum of every rank's contribution to its
own chunks) and attends with its own queries under the causal mask of the global positions,
optionally a sliding window (itself and `window` tokens back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.comm import gather_from_sequence_parallel_region, group_rank, group_size


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of the 2 x cp_size chunks this rank holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_sequence(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's two load-balanced chunks of x along dim, in order."""
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


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    window: int | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence; q, k, v are this
    rank's chunks, [b, heads, s_local, d] (k and v with fewer heads under GQA)."""
    cp_size, cp_rank = group_size(group), group_rank(group)
    local = q.shape[-2]
    seq = local * cp_size

    def gather(x: torch.Tensor) -> torch.Tensor:  # [b, h, s_local, d] -> [b, h, s, d]
        gathered = gather_from_sequence_parallel_region(x.permute(2, 0, 1, 3), group)
        return gathered.permute(1, 2, 0, 3)

    keys, values = gather(k), gather(v)
    query_pos = rank_positions(seq, cp_size, cp_rank, q.device)
    key_pos = torch.cat([rank_positions(seq, cp_size, r, q.device) for r in range(cp_size)])
    back = query_pos[:, None] - key_pos[None, :]
    mask = back >= 0
    if window is not None:
        mask &= back <= window
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, **kwargs)
