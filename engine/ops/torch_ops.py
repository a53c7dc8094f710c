"""The plain PyTorch versions of the fusable ops: the default on CPU, always tested, and the
reference the fused CUDA kernels are checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.tensor_parallel.layers import vocab_parallel_cross_entropy


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, computed in fp32 and cast back (as Llama does)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float):
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [s, b, heads, d] by position; cos/sin are [s, 1, 1, d]. Computed in fp32 and
    cast back, as the fused kernel does, so both paths give the same numbers in bf16."""
    x32 = x.float()
    return (x32 * cos.float() + rotate_half(x32) * sin.float()).to(x.dtype)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """h = [gate | up] along the last dimension -> silu(gate) * up."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class TorchOps:
    """The op set the model calls (engine/ops/__init__.py picks this or FusedOps)."""

    name = "PyTorch"
    rms_norm = staticmethod(rms_norm)
    layer_norm = staticmethod(layer_norm)
    rotary = staticmethod(rotary)
    swiglu = staticmethod(swiglu)
    cross_entropy = staticmethod(vocab_parallel_cross_entropy)
