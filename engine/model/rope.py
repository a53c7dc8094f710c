"""Rotary position embedding tables, for the rotate-half layout (the one Hugging Face Llama
uses); the rotation itself is an op (engine/ops), fused on GPU."""

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
