"""Collectives for tensor and sequence parallelism, as autograd functions.

Tensor parallel (TP) region helpers (Megatron-LM's names):
  copy_to_tensor_parallel_region       forward identity,         backward all-reduce
  reduce_from_tensor_parallel_region   forward all-reduce (in place), backward identity
  sum_over_tensor_parallel_region      forward all-reduce,       backward all-reduce (a sum
                                       every rank's own computation reads, e.g. a norm's
                                       squares over heads split across ranks)
  scatter_to_tensor_parallel_region    forward split last dim,   backward all-gather last dim
  gather_from_tensor_parallel_region   forward all-gather last,  backward split last dim
Sequence parallel (SP) helpers, along dim 0 (activations are [sequence, batch, hidden]):
  scatter_to_sequence_parallel_region      forward split,          backward all-gather
  gather_from_sequence_parallel_region     forward all-gather,     backward reduce-scatter
  reduce_scatter_to_sequence_parallel_region forward reduce-scatter, backward all-gather

A group of None means "no parallelism here": every helper is then the identity. Given a
`times` (parallel.timing.StepTimes), each helper counts its communication, forward and
backward, as the part "tp-comm".
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.comm import all_gather_into, group_rank, group_size, reduce_scatter_into
from parallel.timing import measure

TP_COMM = "tp-comm"  # the time-breakdown part of tensor-parallel communication


def measure_tp_comm(times, group):
    """Count what runs inside as "tp-comm" in `times`, when there are TP ranks to talk to."""
    return measure(times if group is not None else None, TP_COMM)


# --- raw operations ----------------------------------------------------------------------


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=-1)[group_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    moved = x.movedim(-1, 0).contiguous()
    out = torch.empty((size * moved.shape[0],) + moved.shape[1:], dtype=x.dtype, device=x.device)
    all_gather_into(out, moved, group)
    return out.movedim(0, -1).contiguous()


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by TP size {size}")
    return x.chunk(size, dim=0)[group_rank(group)].contiguous()


def _gather_first(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
    all_gather_into(out, x, group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by TP size {size}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size,) + x.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, x, group)
    return out


# --- autograd functions ------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, times):
        ctx.group, ctx.times = group, times
        return x

    @staticmethod
    def backward(ctx, grad):
        # A copy: autograd may hand the same gradient tensor to other branches. The linears
        # do not come here; their input gradient is fresh and reduced in place (tp_linear.py).
        with measure(ctx.times, TP_COMM):
            return _all_reduce(grad, ctx.group), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, times):
        with measure(times, TP_COMM):
            if group is None or not x.is_contiguous() or (x.is_leaf and x.requires_grad):
                return _all_reduce(x, group)
            # In place, no copy: callers pass a fresh product (a linear's partial output) that
            # no other operation saved; mark_dirty makes autograd refuse, not miscompute,
            # otherwise.
            dist.all_reduce(x, group=group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _SumOverRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, times):
        ctx.group, ctx.times = group, times
        with measure(times, TP_COMM):
            return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        with measure(ctx.times, TP_COMM):
            return _all_reduce(grad, ctx.group), None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, times):
        ctx.group, ctx.times = group, times
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        with measure(ctx.times, TP_COMM):
            return _gather_last(grad, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, times):
        ctx.group = group
        with measure(times, TP_COMM):
            return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, times):
        ctx.group, ctx.times = group, times
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        with measure(ctx.times, TP_COMM):
            return _gather_first(grad, ctx.group), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce_grads, times):
        ctx.group, ctx.reduce_grads, ctx.times = group, reduce_grads, times
        with measure(times, TP_COMM):
            return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.reduce_grads:
            return _split_first(grad, ctx.group), None, None, None
        with measure(ctx.times, TP_COMM):
            return _reduce_scatter_first(grad, ctx.group), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, times):
        ctx.group, ctx.times = group, times
        with measure(times, TP_COMM):
            return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        with measure(ctx.times, TP_COMM):
            return _gather_first(grad, ctx.group), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group, times=None) -> torch.Tensor:
    return x if group is None else _CopyToRegion.apply(x, group, times)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group, times=None) -> torch.Tensor:
    return x if group is None else _ReduceFromRegion.apply(x, group, times)


def sum_over_tensor_parallel_region(x: torch.Tensor, group, times=None) -> torch.Tensor:
    return x if group is None else _SumOverRegion.apply(x, group, times)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group, times=None) -> torch.Tensor:
    return x if group is None else _ScatterToRegion.apply(x, group, times)


def gather_from_tensor_parallel_region(x: torch.Tensor, group, times=None) -> torch.Tensor:
    return x if group is None else _GatherFromRegion.apply(x, group, times)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group, times=None) -> torch.Tensor:
    return x if group is None else _ScatterToSequence.apply(x, group, times)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group, tensor_parallel_output_grad: bool = True, times=None
) -> torch.Tensor:
    """All-gather along the sequence. Backward reduce-scatters when the gathered tensor feeds
    TP-split computation (each rank's gradient is partial), else just splits."""
    if group is None:
        return x
    return _GatherFromSequence.apply(x, group, tensor_parallel_output_grad, times)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group, times=None) -> torch.Tensor:
    return x if group is None else _ReduceScatterToSequence.apply(x, group, times)
