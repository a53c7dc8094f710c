"""What a router saw in a step's training forwards (read by engine/monitor/moe_metrics.py):
the sum of each MoE loss over its coefficient, under megatron-core's names (LOSS_NAMES), the
tokens each expert received, the (token, expert) choices dropped over capacity and all
choices made, and the forwards counted."""

from __future__ import annotations

import torch

LOSS_NAMES = (
    "load_balancing_loss",
    "seq_load_balancing_loss",
    "global_load_balancing_loss",
    "z_loss",
)


class RouterStepStats:
    def __init__(self, experts: int, topk: int, device):
        self.topk = topk
        self.losses = torch.zeros(len(LOSS_NAMES), dtype=torch.float64, device=device)
        self.counts = torch.zeros(experts, dtype=torch.float64, device=device)
        self.dropped = torch.zeros(2, dtype=torch.float64, device=device)  # dropped, all
        self.forwards = 0

    def add(self, losses: dict, routing_map: torch.Tensor, dropped: torch.Tensor) -> None:
        for index, name in enumerate(LOSS_NAMES):
            if name in losses:
                self.losses[index] += losses[name].double()
        self.counts += routing_map.sum(dim=0).double()
        self.dropped[0] += dropped.double()
        self.dropped[1] += routing_map.shape[0] * self.topk
        self.forwards += 1
