"""Fusable ops and the choice between the fused CUDA kernels and plain PyTorch.

`select_ops(device, use_fused)` is called once at start: on CUDA the fused kernels are used
when they build (--use-fused-kernels / --no-use-fused-kernels force it either way); on CPU the
PyTorch ops always are, and asking for fused kernels there is a clear error.
`agree_on_ops` then makes every rank run the same set: if the kernels failed to build on any
rank, all ranks use the PyTorch ops (ranks that computed with different numerics would drift
apart silently).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from engine.errors import ConfigError
from engine.ops.torch_ops import TorchOps

log = logging.getLogger(__name__)


def select_ops(device: torch.device, use_fused: bool | None = None):
    """The op set for this run; see the module docstring."""
    if use_fused is False:
        return TorchOps()
    if device.type != "cuda":
        if use_fused:
            raise ConfigError(
                "--use-fused-kernels needs a CUDA device; drop it (the PyTorch ops run on CPU)"
            )
        return TorchOps()
    from engine.ops.fused import FusedOps, build_kernels

    try:
        return FusedOps(build_kernels())
    except Exception as err:  # noqa: BLE001 - any build failure falls back, loudly
        if use_fused:
            raise ConfigError(
                f"--use-fused-kernels: the CUDA kernels in csrc/fused did not build ({err}); "
                "check nvcc and CUDA_HOME, or run with --no-use-fused-kernels"
            ) from None
        log.warning("fused kernels unavailable (%s); using the PyTorch ops", err)
        return TorchOps()


def agree_on_ops(ops, group, device: torch.device):
    """ops where every rank of group chose the fused kernels, else the PyTorch ops on every
    rank (with a warning where the fused ones are given up). Collective over group."""
    if group is None or dist.get_world_size(group) == 1:
        return ops
    fused = torch.tensor([0 if isinstance(ops, TorchOps) else 1], device=device)
    dist.all_reduce(fused, op=dist.ReduceOp.MIN, group=group)
    if fused.item() == 1 or isinstance(ops, TorchOps):
        return ops
    log.warning("the fused kernels did not build on every rank; all ranks use the PyTorch ops")
    return TorchOps()


__all__ = ["agree_on_ops", "select_ops", "TorchOps"]
