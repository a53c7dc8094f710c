"""How the model's arithmetic runs (`RuntimeConfig`): the device, the precision, the kernels and
compilation."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.config.fields import option
from engine.config.fp8 import Fp8Options
from engine.errors import ConfigError


@dataclass(frozen=True)
class RuntimeConfig(Fp8Options):
    """Device, precision, kernels and compilation (FP8's flags: engine/config/fp8.py)."""

    bf16: bool = option(False, "bf16 parameters and activations, fp32 master weights and grads")
    fp16: bool = option(False, "fp16 with dynamic loss scaling, fp32 master weights and grads")
    tf32: bool = option(
        True,
        "on GPUs, fp32 matmuls run on TF32 tensor cores (torch's 'high' float32 matmul "
        "precision); --no-tf32 keeps them in full fp32",
        flag="--no-tf32",
        action="store_false",
    )
    torch_compile: bool = option(
        False,
        "compile each transformer layer's forward with torch.compile (off by default until "
        "measured on a GPU; weight gradients are then not deferred by zero-bubble schedules)",
    )
    grad_reduce_in_bf16: bool = option(
        False,
        "with --bf16: accumulate and reduce gradients in bf16 (half the traffic; default fp32); "
        "the update still runs in fp32",
    )
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    deterministic_mode: bool = option(
        False,
        "torch's deterministic algorithms only (an op without one raises); on GPUs NCCL_ALGO "
        "must name one all-reduce algorithm and the PyTorch ops run instead of the fused "
        "kernels (as Megatron-LM)",
    )
    distributed_backend: str | None = option(
        None,
        "the process groups' backend: nccl (GPUs) or gloo (CPU); default the device's, and "
        "refused where it contradicts the device",
        choices=["nccl", "gloo"],
    )
    use_fused_kernels: bool | None = option(
        None,
        "fused CUDA kernels for norms, RoPE, SwiGLU and cross-entropy (default: on CUDA "
        "when they build; never on CPU)",
        action=argparse.BooleanOptionalAction,
    )
    transformer_impl: str = option(
        "local", "layer implementation", choices=["local", "transformer_engine"]
    )

    def validate(self) -> None:
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 contradict each other; pick one")
        if self.fp16 and self.fp8_param_gather:
            raise ConfigError(
                "--fp8-param-gather with --fp16: a small weight's FP8 values (value / scale) "
                "fall below fp16's range and would not quantise back to the gathered bytes; "
                "use --bf16 or fp32"
            )
