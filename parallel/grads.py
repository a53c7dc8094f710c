"""What happens to gradients between the last backward and the optimizer step.

finalize_model_grads: (1) with pipeline parallelism and tied embeddings, all-reduce the
word-embedding gradient between the first and last stage so both copies take the same step
(or, when one rank holds both, as zb-v's first rank does, add them there);
(2) finish the data-parallel bucket reductions; (3) sum the partial gradients of
TP-replicated parameters over the TP group (see parallel.tensor_parallel.sharding). Every step is a
sum, so the order is free mathematically, but (1) must come before (2): with the distributed
optimizer a rank's main_grad is only valid inside its own shard after (2), and the two stages shard
their copies of the embedding differently. (3) is safe after (2) because the TP ranks of one
DP rank lay out their buffers identically: with sharded gradients it sums the parts of the
TP-replicated parameters inside each rank's shard, which are the same parts on every TP rank.

Global gradient norm: every parameter counted once across TP, PP and DP: replicated
parameters only on TP rank 0, the last stage's copy of a tied embedding not at all, and (with
the distributed optimizer) each DP rank only its own shard.
"""

from __future__ import annotations

import torch

from parallel.comm import all_reduce
from parallel.tensor_parallel.layers import all_reduce_flat, has_tp_partial_grad


def finalize_model_grads(ddps, tp_group, embedding_group=None, shared_embeddings=()) -> None:
    """Make main_grad final on every rank (see module docstring)."""
    shared_embeddings = list(shared_embeddings)
    if len(shared_embeddings) == 2:  # both copies on this rank (zb-v's V): sum them here
        first, second = (weight.main_grad for weight in shared_embeddings)
        first.add_(second)
        second.copy_(first)
    elif embedding_group is not None:
        for weight in shared_embeddings:
            all_reduce(weight.main_grad, embedding_group)
    for ddp in ddps:
        ddp.finish_grad_sync()
    partial = [
        grad
        for ddp in ddps
        for param in ddp.params
        if has_tp_partial_grad(param)
        for grad in ddp.reduced_grads(param)
    ]
    all_reduce_flat(partial, tp_group)


def counts_toward_norm(param, tp_rank: int) -> bool:
    from parallel.tensor_parallel.sharding import is_tp_duplicate

    if getattr(param, "shared_embedding", False):
        return False
    return not is_tp_duplicate(param, tp_rank)


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[sum of squares of grads] in float64 on device: the device of the group the sum is
    reduced over, also on a rank with no gradients of its own (NCCL refuses CPU tensors)."""
    total = torch.zeros(1, dtype=torch.float64, device=device)
    if grads:
        total += torch.nn.utils.get_total_norm(grads, 2.0).double().to(device) ** 2
    return total


def agreed_norm(squares: torch.Tensor, consensus_group=None) -> float:
    """sqrt of a sum of squares already summed so that every element counts once (inf/NaN
    anywhere gives a non-finite norm).

    consensus_group: ranks that hold the same gradients (DP replicas without the distributed
    optimizer) take the maximum, so whether a step is skipped is decided identically on every
    rank even if one replica's gradient went bad on its own."""
    total = squares
    if consensus_group is not None:
        total = torch.where(torch.isfinite(total), total, torch.full_like(total, float("inf")))
        all_reduce(total, consensus_group, op=torch.distributed.ReduceOp.MAX)
    return total.sqrt().item()


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Factor that scales gradients to max_norm (1.0 when already below, or clipping off)."""
    if max_norm <= 0.0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
