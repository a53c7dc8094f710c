"""The all-to-all that moves tokens between expert-parallel ranks, differentiable: its backward
is the all-to-all back (each gradient returns to where its row came from). Given a `times`
(parallel.timing.StepTimes), forward and backward count as the time-breakdown part
"a2a-comm"."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.timing import measure

A2A_COMM = "a2a-comm"  # the time-breakdown part of the experts' token exchanges


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, received: list[int], sent: list[int], group, times):
        ctx.received, ctx.sent, ctx.group, ctx.times = received, sent, group, times
        out = rows.new_empty((sum(received), *rows.shape[1:]))
        with measure(times, A2A_COMM):
            dist.all_to_all_single(out, rows.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        with measure(ctx.times, A2A_COMM):
            dist.all_to_all_single(back, grad.contiguous(), ctx.sent, ctx.received, group=ctx.group)
        return back, None, None, None, None


def all_to_all(
    rows: torch.Tensor, received: list[int], sent: list[int], group, times=None
) -> torch.Tensor:
    """rows [sum(sent), ...], sent[r] of them (in rank order) to rank r of `group` ->
    [sum(received), ...], received[r] of them from rank r, in rank order."""
    return _AllToAll.apply(rows, received, sent, group, times)
