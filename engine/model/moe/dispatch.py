"""Tokens to their experts and back (the dispatch of one MoE layer, without expert parallelism:
every expert is on this rank).

`permute` groups a rank's (token, chosen expert) pairs by expert, expert 0's first and each
expert's in token order (megatron-core's order), by masked selection on the expert-major routing
map: no loop over tokens. `unpermute` adds each pair's expert output back onto its token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
