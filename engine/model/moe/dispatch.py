"""Tokens to their experts and back (the dispatch of one MoE layer).

`permute` groups a rank's (token, chosen expert) pairs by expert, expert 0's first and each
expert's in token order (megatron-core's order), by masked selection on the expert-major routing
map: no loop over tokens. `unpermute` adds each pair's expert output back onto its token. With
expert parallelism, `exchange` sends each row (and its probability) to the rank holding its
expert, by all-to-all, and regroups what arrives by local expert; `exchange_back` returns the
experts' outputs the same way (megatron-core's all-to-all dispatcher).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.expert_parallel.all_to_all import all_to_all


@dataclass(frozen=True)
class Permutation:
    """Where the grouped rows came from: `token_index` [N] (each row's token), `counts` [E]
    (rows per expert, on the host)."""

    token_index: torch.Tensor
    counts: list[int]


def permute(
    tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Permutation]:
    """tokens [T, h], routing map and probs [T, E] -> (rows [N, h], their probs [N], the
    permutation), N the chosen (token, expert) pairs."""
    num_tokens, num_experts = routing_map.shape
    by_expert = routing_map.t().contiguous()  # [E, T]
    every = torch.arange(num_tokens, device=tokens.device).unsqueeze(0).expand(num_experts, -1)
    token_index = every.masked_select(by_expert)
    row_probs = probs.t().contiguous().masked_select(by_expert)
    counts = by_expert.sum(dim=1).tolist()
    return tokens.index_select(0, token_index), row_probs, Permutation(token_index, counts)


def unpermute(rows: torch.Tensor, permutation: Permutation, num_tokens: int) -> torch.Tensor:
    """rows [N, h] (each already scaled by its probability) -> [T, h]: the sum over each
    token's experts."""
    out = torch.zeros(num_tokens, rows.shape[-1], dtype=rows.dtype, device=rows.device)
    return out.index_add(0, permutation.token_index, rows)


@dataclass(frozen=True)
class Exchange:
    """How one dispatch over an expert-parallel group moved the rows: `sent` / `received`
    per rank, `order` the received rows' positions regrouped by local expert (the rows
    arrive grouped by source rank, each rank's grouped by expert), and `counts` the rows of
    each local expert."""

    sent: list[int]
    received: list[int]
    order: torch.Tensor
    counts: list[int]


def exchange(
    rows: torch.Tensor, row_probs: torch.Tensor, counts: list[int], ep_group, ep_size: int
) -> tuple[torch.Tensor, torch.Tensor, Exchange]:
    """Rows grouped by global expert (`permute`'s, `counts` per expert) -> each EP rank's
    rows of its own experts (experts [r x E/EP, (r + 1) x E/EP) on rank r), grouped by local
    expert, with their probabilities. Collective over `ep_group`."""
    local = len(counts) // ep_size
    mine = torch.tensor(counts, dtype=torch.int64, device=rows.device).view(ep_size, local)
    theirs = torch.empty_like(mine)  # theirs[src, e]: rows rank src sends to my expert e
    dist.all_to_all_single(theirs, mine, group=ep_group)
    sent = mine.sum(dim=1).tolist()
    received = theirs.sum(dim=1).tolist()
    rows = all_to_all(rows, received, sent, ep_group)
    row_probs = all_to_all(row_probs, received, sent, ep_group)
    # regroup [src][expert] -> [expert][src], by whole chunks (no loop over rows)
    sizes = theirs.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    chunks = torch.arange(ep_size * local, device=rows.device).view(ep_size, local).t().reshape(-1)
    order = torch.cat(
        [torch.arange(int(sizes[c]), device=rows.device) + int(starts[c]) for c in chunks.tolist()]
        or [torch.zeros(0, dtype=torch.int64, device=rows.device)]
    )
    moved = Exchange(sent, received, order, theirs.sum(dim=0).tolist())
    return rows.index_select(0, order), row_probs.index_select(0, order), moved


def exchange_back(rows: torch.Tensor, moved: Exchange, ep_group) -> torch.Tensor:
    """The experts' output rows (grouped by local expert) back to the ranks they came from,
    in the order `exchange` received them from `permute`."""
    by_source = torch.empty_like(rows).index_copy(0, moved.order, rows)
    return all_to_all(by_source, moved.sent, moved.received, ep_group)
