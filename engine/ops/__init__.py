"""Fusable ops and the choice between the fused CUDA kernels and plain PyTorch.

`select_ops(device, use_fused)` is called once at start: on CUDA the fused kernels are used
when they build (--use-fused-kernels / --no-use-fused-kernels force it either way); on CPU the
PyTorch ops always are, and asking for fused kernels there is a clear error.
"""

from __future__ import annotations

import logging

import torch

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


__all__ = ["select_ops", "TorchOps"]
