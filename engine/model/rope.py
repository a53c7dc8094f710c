"""Rotary position embedding tables, for the rotate-half layout (the one Hugging Face Llama
uses); the rotation itself is an op (engine/ops), fused on GPU. The scaling the flags ask for
(llama3, linear, dynamic NTK, YaRN) is read by engine/config/rope_scaling.py; the tables apply
it here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.config.rope_scaling import YarnScaling, rope_scaling_of


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


def _inverse_frequencies(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def _yarn_inverse_frequencies(yarn: YarnScaling, base: float, dim: int) -> torch.Tensor:
    """YaRN's blend of extrapolated and interpolated inverse frequencies
    (engine/config/rope_scaling.py)."""
    low, high = yarn.ramp_bounds(base, dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = _inverse_frequencies(base, dim)
    return extrapolated / yarn.factor * ramp + extrapolated * (1 - ramp)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given token positions over a head of size dim; `scaling` is
    engine/config/rope_scaling.py's rope_scaling_of (None: plain RoPE). `max_positions`: the length
    dynamic scaling starts above. The inverse frequencies live on `device` (the model's), so a
    forward copies nothing from the host."""

    def __init__(
        self,
        dim: int,
        base: float = 10000.0,
        scaling: dict | None = None,
        max_positions: int | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.dim, self.base, self.max_positions = dim, base, max_positions
        kind = scaling["rope_type"] if scaling else None
        self.kind, self.factor = kind, scaling["factor"] if scaling else 1.0
        self.attention_factor = 1.0
        inv_freq = _inverse_frequencies(base, dim)
        if kind == "llama3":
            inv_freq = Llama3Scaling(
                scaling["factor"],
                scaling["low_freq_factor"],
                scaling["high_freq_factor"],
                scaling["original_max_position_embeddings"],
            ).apply(inv_freq)
        elif kind == "yarn":
            yarn = YarnScaling.from_parameters(scaling)
            inv_freq = _yarn_inverse_frequencies(yarn, base, dim)
            self.attention_factor = yarn.attention_factor()
        # computed on the CPU (the same values everywhere), kept on the model's device
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    @classmethod
    def for_config(cls, cfg, device: torch.device | str | None = None) -> RotaryEmbedding:
        scaling = rope_scaling_of(cfg)
        return cls(cfg.rotary_dim, cfg.rotary_base, scaling, cfg.max_positions, device)

    def _dynamic_inv_freq(self, seq_length: int) -> torch.Tensor:
        if seq_length <= self.max_positions:
            return self.inv_freq
        stretch = self.factor * seq_length / self.max_positions - (self.factor - 1)
        return _inverse_frequencies(self.base * stretch ** (self.dim / (self.dim - 2)), self.dim)

    def forward(
        self, positions: torch.Tensor, seq_length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables [s, 1, 1, d] for positions [s] (0..s-1 without context parallelism), or
        [s, b, 1, d] for each sample's own positions [b, s] (--reset-position-ids);
        seq_length: the whole sequence's (dynamic scaling; default the last position + 1)."""
        device = positions.device
        positions = positions.to(torch.float32)
        inv_freq = self.inv_freq
        if self.kind == "linear":
            positions = positions / self.factor
        elif self.kind == "dynamic":
            length = seq_length if seq_length is not None else int(positions.max()) + 1
            inv_freq = self._dynamic_inv_freq(length)
        freqs = positions[..., None] * inv_freq.to(device)
        angles = torch.cat([freqs, freqs], dim=-1)  # [s, d] or [b, s, d]
        if angles.dim() == 2:
            angles = angles[:, None, None, :]  # [s, 1, 1, d]
        else:
            angles = angles.transpose(0, 1)[:, :, None, :]  # [s, b, 1, d]
        if self.attention_factor != 1.0:
            return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        return angles.cos(), angles.sin()
