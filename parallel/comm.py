"""The collectives every parallel part shares.

A group of None means "no parallelism here": the helpers are then no-ops. The flat
`all_gather_into` / `reduce_scatter_into` are the only callers of torch's tensor-level gather
and reduce-scatter (their names differ between torch 2.11 and 2.13; the choice is made here).
The autograd-aware collectives of tensor and sequence parallelism are in
parallel/tensor_parallel/regions.py. Each helper first checks that its group's backend takes
the tensors' devices (NCCL moves CUDA tensors only; gloo hides such a mistake).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour of the
# *_single names, which torch 2.11 does not have yet.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def device_problem(backend: str, tensors: tuple[torch.Tensor, ...]) -> str | None:
    """Why a collective of this backend cannot take these tensors (None: it can): NCCL moves
    CUDA tensors only."""
    if backend == "nccl":
        for tensor in tensors:
            if tensor.device.type != "cuda":
                return f"an NCCL collective was handed a tensor on {tensor.device}"
    return None


def check_devices(group, *tensors: torch.Tensor) -> None:
    """Raise before a collective that its backend would refuse (or hang on)."""
    problem = device_problem(dist.get_backend(group), tensors)
    if problem is not None:
        raise RuntimeError(f"{problem}: build it on the group's device (the rank's GPU)")


def all_gather_into(output: torch.Tensor, input_: torch.Tensor, group, async_op: bool = False):
    """output (size * n along dim 0) <- every rank's input, concatenated in rank order."""
    check_devices(group, output, input_)
    return _ALL_GATHER(output, input_, group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, input_: torch.Tensor, group, async_op: bool = False):
    """output <- this rank's 1/size slice (dim 0) of the sum of every rank's input."""
    check_devices(group, output, input_)
    return _REDUCE_SCATTER(output, input_, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce; a no-op without a group."""
    if group is None:
        return None
    check_devices(group, tensor)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
