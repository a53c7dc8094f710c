"""Tokens to their experts and back (the dispatch of one MoE layer).

`permute` groups a rank's (token, chosen expert) pairs by expert, expert 0's first and each
expert's in token order (megatron-core's order), by masked selection on the expert-major routing
map: no loop over tokens. `unpermute` adds each pair's expert output back onto its token. With
expert parallelism, `exchange` sends each row (and its probability) to the rank holding its
expert, by all-to-all, and regroups what arrives by local expert; `exchange_back` returns the
experts' outputs the same way (megatron-core's all-to-all dispatcher). With expert tensor
parallelism `gather_expert_tp` then gives every rank sharing an expert all of its rows and
`scatter_expert_tp` sums their partial outputs back onto the rows' own rank. Given a `times`
(parallel.timing.StepTimes), their collectives count as the time-breakdown part "a2a-comm".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.comm import all_gather_into
from parallel.expert_parallel.all_to_all import A2A_COMM, all_to_all
from parallel.timing import measure


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
    rows: torch.Tensor,
    row_probs: torch.Tensor,
    counts: list[int],
    ep_group,
    ep_size: int,
    times=None,
) -> tuple[torch.Tensor, torch.Tensor, Exchange]:
    """Rows grouped by global expert (`permute`'s, `counts` per expert) -> each EP rank's
    rows of its own experts (experts [r x E/EP, (r + 1) x E/EP) on rank r), grouped by local
    expert, with their probabilities. Collective over `ep_group`."""
    local = len(counts) // ep_size
    mine = torch.tensor(counts, dtype=torch.int64, device=rows.device).view(ep_size, local)
    theirs = torch.empty_like(mine)  # theirs[src, e]: rows rank src sends to my expert e
    with measure(times, A2A_COMM):
        dist.all_to_all_single(theirs, mine, group=ep_group)
        sent = mine.sum(dim=1).tolist()
        received = theirs.sum(dim=1).tolist()
    rows = all_to_all(rows, received, sent, ep_group, times)
    row_probs = all_to_all(row_probs, received, sent, ep_group, times)
    order = _by_expert(theirs, rows.device)
    moved = Exchange(sent, received, order, theirs.sum(dim=0).tolist())
    return rows.index_select(0, order), row_probs.index_select(0, order), moved


def _by_expert(sizes: torch.Tensor, device) -> torch.Tensor:
    """The positions that regroup rows arranged [source rank][expert] (`sizes` [ranks,
    experts] of them) as [expert][source rank], by whole chunks (no loop over rows)."""
    ranks, experts = sizes.shape
    flat = sizes.reshape(-1).tolist()  # one copy to the host
    starts = [0, *itertools.accumulate(flat)]
    chunks = [r * experts + e for e in range(experts) for r in range(ranks)]
    return torch.cat(
        [torch.arange(starts[c], starts[c] + flat[c], device=device) for c in chunks]
        or [torch.zeros(0, dtype=torch.int64, device=device)]
    )


def exchange_back(rows: torch.Tensor, moved: Exchange, ep_group, times=None) -> torch.Tensor:
    """The experts' output rows (grouped by local expert) back to the ranks they came from,
    in the order `exchange` received them from `permute`."""
    by_source = torch.empty_like(rows).index_copy(0, moved.order, rows)
    return all_to_all(by_source, moved.sent, moved.received, ep_group, times)


def gather_expert_tp(
    rows: torch.Tensor,
    row_probs: torch.Tensor,
    counts: list[int],
    group,
    size: int,
    times=None,
) -> tuple[torch.Tensor, torch.Tensor, Exchange]:
    """Expert tensor parallelism: every rank of the expert tensor-parallel `group` (which
    share each expert, each holding a shard) gets the rows of all of them, grouped by local
    expert (`counts` rows per expert here), with their probabilities; megatron-core's
    all-gather of the tokens. An all-to-all sending this rank's rows to each rank, so its
    backward sums each row's gradient over the shards. Collective over `group`."""
    mine = torch.tensor(counts, dtype=torch.int64, device=rows.device)
    theirs = torch.empty(size * len(counts), dtype=torch.int64, device=rows.device)
    with measure(times, A2A_COMM):
        all_gather_into(theirs, mine, group)
        theirs = theirs.view(size, len(counts))  # theirs[src, e]: rank src's rows of expert e
        sent, received = [rows.shape[0]] * size, theirs.sum(dim=1).tolist()
    copies = rows.repeat(size, *([1] * (rows.dim() - 1)))
    rows = all_to_all(copies, received, sent, group, times)
    row_probs = all_to_all(row_probs.repeat(size), received, sent, group, times)
    order = _by_expert(theirs, rows.device)
    gathered = Exchange(sent, received, order, theirs.sum(dim=0).tolist())
    return rows.index_select(0, order), row_probs.index_select(0, order), gathered


def scatter_expert_tp(partial: torch.Tensor, gathered: Exchange, group, times=None) -> torch.Tensor:
    """The experts' partial outputs of every row (each shard's part) back to the rank the row
    came from, summed over the shards: megatron-core's reduce-scatter."""
    by_source = torch.empty_like(partial).index_copy(0, gathered.order, partial)
    parts = all_to_all(by_source, gathered.sent, gathered.received, group, times)
    return parts.view(len(gathered.sent), -1, *parts.shape[1:]).sum(dim=0)
