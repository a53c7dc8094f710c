"""Straggler reports (--log-straggler): each rank's own compute time per iteration, gathered at
every log line, and the ranks slower than the median by more than --straggler-threshold named
with their node.

A rank's own time is what the time breakdown (parallel/timing.py) counts as its work: forward
and backward compute (tensor-parallel collectives are measured apart and taken out), the
optimizer and reading its batches. Waits for peers (pipeline receives, gradient and loss
reductions) are left out: a slow rank makes the others wait, and only its own time shows it.
On a GPU the flag makes the time breakdown synchronise at each part's ends (as
--timing-log-level 1 does), so that each part's kernels are counted in it and not in a later
wait.
"""

from __future__ import annotations

import socket
import statistics

import torch
import torch.distributed as dist

OWN_WORK = ("forward-compute", "backward-compute", "optimizer", "batch-generator")


class StragglerMonitor:
    """Collective at start (the ranks' host names) and at every log line (their times)."""

    def __init__(self, state, threshold: float, minmax_count: int):
        self.state, self.threshold, self.minmax_count = state, threshold, minmax_count
        self.hosts = [socket.gethostname()]
        if state.world_group is not None:
            self.hosts = [None] * state.world_size
            dist.all_gather_object(self.hosts, socket.gethostname(), group=state.world_group)

    def gather(self, parts: dict[str, float], iterations: int) -> list[float]:
        """Every rank's own seconds per iteration over the window that ends here."""
        own = sum(parts.get(name, 0.0) for name in OWN_WORK) / max(iterations, 1)
        value = torch.tensor([own], dtype=torch.float64, device=self.state.device)
        if self.state.world_group is None:
            return [own]
        every = [torch.zeros_like(value) for _ in range(self.state.world_size)]
        dist.all_gather(every, value, group=self.state.world_group)
        return torch.cat(every).tolist()

    def lines(self, per_rank: list[float], iteration: int) -> list[str]:
        """The console lines: the stragglers, and the slowest and fastest ranks."""
        median = max(statistics.median(per_rank), 1e-12)
        order = sorted(range(len(per_rank)), key=lambda r: per_rank[r], reverse=True)

        def who(rank: int) -> str:
            return f"rank {rank} ({self.hosts[rank]}) {per_rank[rank]:.3f} s"

        out = []
        slow = [r for r in order if per_rank[r] > median * (1 + self.threshold)]
        if slow:
            out.append(
                f"stragglers at iteration {iteration} (own compute per iteration, median "
                f"{median:.3f} s, --straggler-threshold {self.threshold:g}): "
                + ", ".join(f"{who(r)} (+{per_rank[r] / median - 1:.0%})" for r in slow)
            )
        k = min(self.minmax_count, len(order))
        if k:
            out.append(
                f"own compute per iteration at {iteration}: slowest "
                + ", ".join(who(r) for r in order[:k])
                + "; fastest "
                + ", ".join(who(r) for r in reversed(order[-k:]))
            )
        return out
