"""The router's arithmetic, as functions of tensors (megatron-core 0.16.1's semantics, held to its
own layer in tests/test_moe_megatron.py): scores and the top-k choice, Sinkhorn, capacity
dropping and the load-balancing and z losses.

Shapes: logits and scores [T, E] (T tokens, E experts); a routing map is a boolean [T, E] with
the chosen experts of each token set; probabilities are [T, E], zero where the map is unset.
"""

from __future__ import annotations

import math

import torch


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the top-k experts of each token among the experts of its best
    `group_topk` groups, a group scored by the sum of its top (topk // group_topk) scores."""
    tokens, experts = scores.shape
    per_group = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = per_group.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    allowed = torch.zeros_like(group_scores).scatter(1, chosen, 1).bool()
    allowed = allowed.unsqueeze(-1).expand(-1, -1, experts // num_groups).reshape(tokens, -1)
    return scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1)


def _topk(scores, topk, num_groups, group_topk):
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return scores.topk(topk, dim=1)


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing map) of top-k routing.

    softmax: over all experts then the top k (`pre_softmax`), or over the top k logits (the
    chosen experts' probabilities renormalised). sigmoid: each score sigmoid(logit), the top k
    chosen by score + `expert_bias` (when given) and, for k > 1, divided by their sum. Then
    times `scaling_factor`."""
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, indices = _topk(scores, topk, num_groups, group_topk)
        else:
            top, indices = _topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, indices = _topk(scores + expert_bias, topk, num_groups, group_topk)
            probs = scores.gather(1, indices).type_as(logits)
        else:
            probs, indices = _topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"unknown score function {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    dense = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    routing_map.scatter_(1, indices, True)
    return dense, routing_map


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn's balancing of exp(cost) into (approximately) equal row and column sums."""
    cost = torch.exp(cost)
    rows = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    cols = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, previous = 1e-8, 1e9, cols
    while error > tol:
        rows = (1 / rows.size(0)) * 1 / (torch.sum(cols * cost, 1) + eps)
        cols = (1 / cols.size(0)) * 1 / (torch.sum(rows.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(previous - cols))
        previous = cols
    return cols * cost * rows.unsqueeze(1)


def sinkhorn_routing(
    logits: torch.Tensor, topk: int, training: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing map) of Sinkhorn load balancing: in training the experts are chosen on
    the Sinkhorn-balanced logits; the probabilities are sigmoid (top-1) or softmax scores."""

    def activation(x):
        if topk == 1:
            return torch.sigmoid(x)
        return torch.softmax(x, dim=-1, dtype=torch.float32).type_as(x)

    if training:
        with torch.no_grad():
            indices = sinkhorn(logits.float()).topk(topk, dim=1).indices
        scores = activation(logits)
    else:
        scores = activation(logits)
        indices = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    routing_map.scatter_(1, indices, True)
    return scores * routing_map, routing_map


def expert_capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """Tokens an expert takes at most: ceil(tokens x topk / experts x factor)."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def drop_over_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    factor: float,
    policy: str = "probs",
    pad_to_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert keeps at most its capacity of tokens: those of highest probability
    (`probs`) or the first ones (`position`); with `pad_to_capacity` every expert gets
    exactly its capacity (the padding tokens with probability 0)."""
    tokens, experts = probs.shape
    capacity = expert_capacity(tokens, experts, topk, factor)
    if capacity > tokens:
        keep = torch.ones_like(routing_map)
    else:
        ranked = probs if policy == "probs" else routing_map.int()
        indices = ranked.topk(capacity, dim=0, sorted=False).indices
        keep = torch.zeros_like(probs).scatter(0, indices, 1).bool()
    kept = keep if pad_to_capacity else routing_map & keep
    return probs * kept, kept


def aux_loss_scores(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing map, scores) the load-balancing losses see: the softmax over all experts (or
    sigmoid scores normalised per token) and their plain top k."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    indices = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    routing_map.scatter_(1, indices, True)
    return routing_map, scores


def switch_aux_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_tokens: float,
    topk: int,
    num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss, E x sum_i f_i P_i x coeff, with f_i the
    fraction of the `total_tokens` x topk choices that went to expert i (`tokens_per_expert`,
    counted over the whole token set) and P_i the mean score of expert i; this rank's `scores`
    add its tokens' part of P."""
    return torch.sum(scores.sum(dim=0) * tokens_per_expert) * (
        num_experts * coeff / (topk * total_tokens * total_tokens)
    )


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """The router z-loss: coeff x the mean over tokens of logsumexp(logits)^2."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff
