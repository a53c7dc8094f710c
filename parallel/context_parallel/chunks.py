"""How context parallelism cuts a sequence: 2 x C chunks, CP rank r holding chunks r and
2C-1-r (so every rank has the same causal work: an early chunk sees few keys, its partner
many), and which keys a query sees (causal, optionally within a sliding window)."""

from __future__ import annotations

import torch


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
    queries, keys = query_pos[:, None], key_pos[None, :]
    mask = keys <= queries
    if window is not None:
        mask &= keys >= queries - window
    return mask


WHOLE = ("document_ids",)  # batch entries every CP rank keeps whole


def context_parallel_batches(batches: list[dict], state) -> list[dict]:
    """This CP rank's two load-balanced chunks of every sequence in the micro-batches
    ([b, s] tensors split along s); the batches themselves when there is no CP."""
    if state.cp_size == 1:
        return batches
    # [b, s] tensors are cut along the sequence; a per-sample `domain` [b] stays whole, and
    # so do `document_ids` (attention needs the keys' documents as well as the queries')
    rank, size = state.cp_rank, state.cp_size
    return [
        {
            k: v if k in WHOLE or v.dim() < 2 else split_sequence(v, 1, size, rank)
            for k, v in b.items()
        }
        for b in batches
    ]
