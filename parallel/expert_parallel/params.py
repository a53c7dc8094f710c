"""Which parameters are experts': a mark set where an MoE layer builds its routed experts. With
expert parallelism their gradients are reduced and their optimizer state sharded over the expert
data-parallel group instead of DP x CP (parallel/data_parallel/ddp.py), and their norm summed
over the ranks holding different experts (parallel/data_parallel/optimizer.py)."""

from __future__ import annotations

from torch import nn

ATTRIBUTE = "expert_parallel"


def mark_expert_parallel(param: nn.Parameter) -> None:
    setattr(param, ATTRIBUTE, True)


def is_expert_parallel(param: nn.Parameter) -> bool:
    return getattr(param, ATTRIBUTE, False)
