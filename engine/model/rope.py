"""Rotary position embedding tables, for the rotate-half layout (the one Hugging Face Llama
uses); the rotation itself is an op (engine/ops), fused on GPU.

Two ways to stretch RoPE past the length a model was trained at, with Megatron-LM's flags and
Hugging Face's `rope_type` names:

- Llama 3.x scaling (`--use-rope-scaling`, "llama3"): frequencies whose wavelength exceeds
  original_length / low_freq_factor are divided by the factor, those below original_length /
  high_freq_factor are kept, and those between are interpolated smoothly;
- linear scaling, or position interpolation (`--rotary-seq-len-interpolation-factor`,
  "linear"): positions are divided by the factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Llama3Scaling:
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies (module docstring)."""
        original = self.original_max_position_embeddings
        low_wavelength = original / self.low_freq_factor
        high_wavelength = original / self.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        slowed = torch.where(wavelength > low_wavelength, inv_freq / self.factor, inv_freq)
        smooth = (original / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        between = (1 - smooth) * slowed / self.factor + smooth * slowed
        medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
        return torch.where(medium, between, slowed)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given token positions over a head of size dim."""

    def __init__(
        self,
        dim: int,
        base: float = 10000.0,
        llama3: Llama3Scaling | None = None,
        interpolation: float | None = None,
    ):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if llama3 is not None:
            inv_freq = llama3.apply(inv_freq)
        self.interpolation = interpolation
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def for_config(cls, cfg) -> RotaryEmbedding:
        llama3 = None
        if cfg.use_rope_scaling:
            llama3 = Llama3Scaling(
                cfg.rope_scaling_factor,
                cfg.rope_scaling_low_freq_factor,
                cfg.rope_scaling_high_freq_factor,
                cfg.rope_scaling_original_max_position_embeddings,
            )
        return cls(cfg.rotary_dim, cfg.rotary_base, llama3, cfg.rotary_seq_len_interpolation_factor)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables [s, 1, 1, d] for positions [s] (0..s-1 without context parallelism)."""
        device = positions.device
        positions = positions.to(torch.float32)
        if self.interpolation:
            positions = positions / self.interpolation
        freqs = torch.outer(positions, self.inv_freq.to(device))
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, d]
        return angles.cos(), angles.sin()
