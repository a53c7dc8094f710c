"""Rotary position embedding, in the rotate-half layout (the one Hugging Face Llama uses)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions 0..s-1 over a head of size dim."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(seq_length, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq.to(device))
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, d]
        return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [s, b, heads, d] by position."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin
