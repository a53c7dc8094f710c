"""Rotary position embedding tables, for the rotate-half layout (the one Hugging Face Llama
uses); the rotation itself is an op (engine/ops), fused on GPU.

Four ways to stretch RoPE past the length a model was trained at, by Hugging Face's
`rope_type` names (`--rope-scaling-type`, with `--rope-scaling-factor`), three of them also
with Megatron-LM's flags:

- "llama3" (`--use-rope-scaling`): frequencies whose wavelength exceeds original_length /
  low_freq_factor are divided by the factor, those below original_length / high_freq_factor
  are kept, and those between are interpolated smoothly;
- "linear" (`--rotary-seq-len-interpolation-factor`): positions are divided by the factor;
- "dynamic" (NTK-aware): for a sequence of L > max_position_embeddings tokens the base becomes
  base x (factor x L / max_position_embeddings - (factor - 1)) ^ (d / (d - 2)); shorter ones
  are not scaled;
- "yarn" (`--position-embedding-type yarn`, `--rotary-scaling-factor`): frequency i blends
  the extrapolated 1/base^(2i/d) and the interpolated one / factor by a ramp between the
  dimensions where the original length makes beta_fast and beta_slow rotations, and cos and
  sin are multiplied by the attention factor (0.1 x mscale x ln(factor) + 1, over the same
  with mscale_all_dim when that is set).

`rope_scaling_of(cfg)` is the one reading of these flags (both spellings), in the terms of
config.json's rope_parameters; the tables and the Hugging Face export both use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import ConfigError


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


def rope_scaling_of(cfg) -> dict | None:
    """The RoPE scaling cfg asks for, as config.json's rope_parameters would hold it (without
    rope_theta), or None; ConfigError (one line) when two flags ask for different ones."""
    asked = []
    if cfg.use_rope_scaling:
        asked.append(("llama3", "--use-rope-scaling"))
    if cfg.rotary_seq_len_interpolation_factor:
        asked.append(("linear", "--rotary-seq-len-interpolation-factor"))
    if cfg.position_embedding_type == "yarn":
        asked.append(("yarn", "--position-embedding-type yarn"))
    if cfg.rope_scaling_type:
        asked.append((cfg.rope_scaling_type, f"--rope-scaling-type {cfg.rope_scaling_type}"))
    if len(asked) > 1:
        flags = " and ".join(flag for _, flag in asked)
        raise ConfigError(f"{flags}: RoPE takes one scaling; keep one of them")
    if not asked:
        return None
    kind, flag = asked[0]
    by_type = flag.startswith("--rope-scaling-type")
    factor = float(cfg.rope_scaling_factor)
    if kind == "linear" and not by_type:
        factor = float(cfg.rotary_seq_len_interpolation_factor)
    if kind == "yarn" and not by_type:
        factor = float(cfg.rotary_scaling_factor)
    if factor < 1:
        raise ConfigError(f"{flag}: the scaling factor {factor} must be at least 1")
    out = {"rope_type": kind, "factor": factor}
    if kind == "llama3":
        out |= {
            "low_freq_factor": cfg.rope_scaling_low_freq_factor,
            "high_freq_factor": cfg.rope_scaling_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_scaling_original_max_position_embeddings,
        }
    if kind == "yarn":
        original = cfg.rope_scaling_original_max_position_embeddings
        if not by_type:
            original = cfg.yarn_original_max_position_embeddings or 4096
        yarn = YarnScaling(
            factor,
            original,
            cfg.yarn_beta_fast or 32.0,
            cfg.yarn_beta_slow or 1.0,
            cfg.mscale,
            cfg.mscale_all_dim,
            cfg.yarn_correction_range_round_to_int,
        )
        out |= yarn.parameters()
    return out


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    round_to_int: bool = True

    @classmethod
    def from_parameters(cls, rope: dict) -> YarnScaling:
        return cls(
            rope["factor"],
            rope["original_max_position_embeddings"],
            rope["beta_fast"],
            rope["beta_slow"],
            rope["mscale"],
            rope["mscale_all_dim"],
            rope["truncate"],
        )

    def parameters(self) -> dict:
        """rope_parameters' keys (attention_factor written out, so a reader computes none)."""
        return {
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "mscale": self.mscale,
            "mscale_all_dim": self.mscale_all_dim,
            "truncate": self.round_to_int,
            "attention_factor": self.attention_factor(),
        }

    def attention_factor(self) -> float:
        def scale(coefficient: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * coefficient * math.log(self.factor) + 1.0

        return scale(self.mscale) / scale(self.mscale_all_dim)

    def apply(self, base: float, dim: int) -> torch.Tensor:
        """The blended inverse frequencies (module docstring)."""

        def dimension_of(rotations: float) -> float:  # where the original length turns that often
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(base))

        low, high = dimension_of(self.beta_fast), dimension_of(self.beta_slow)
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolated = _inverse_frequencies(base, dim)
        return extrapolated / self.factor * ramp + extrapolated * (1 - ramp)


def _inverse_frequencies(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given token positions over a head of size dim; `scaling` is
    rope_scaling_of's description (None: plain RoPE). `max_positions`: the length dynamic
    scaling starts above."""

    def __init__(
        self,
        dim: int,
        base: float = 10000.0,
        scaling: dict | None = None,
        max_positions: int | None = None,
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
            inv_freq, self.attention_factor = yarn.apply(base, dim), yarn.attention_factor()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def for_config(cls, cfg) -> RotaryEmbedding:
        return cls(cfg.rotary_dim, cfg.rotary_base, rope_scaling_of(cfg), cfg.max_positions)

    def _dynamic_inv_freq(self, seq_length: int) -> torch.Tensor:
        if seq_length <= self.max_positions:
            return self.inv_freq
        stretch = self.factor * seq_length / self.max_positions - (self.factor - 1)
        return _inverse_frequencies(self.base * stretch ** (self.dim / (self.dim - 2)), self.dim)

    def forward(
        self, positions: torch.Tensor, seq_length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables [s, 1, 1, d] for positions [s] (0..s-1 without context parallelism);
        seq_length: the whole sequence's (dynamic scaling; default the last position + 1)."""
        device = positions.device
        positions = positions.to(torch.float32)
        inv_freq = self.inv_freq
        if self.kind == "linear":
            positions = positions / self.factor
        elif self.kind == "dynamic":
            length = seq_length if seq_length is not None else int(positions.max()) + 1
            inv_freq = self._dynamic_inv_freq(length)
        freqs = torch.outer(positions, inv_freq.to(device))
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, d]
        if self.attention_factor != 1.0:
            return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        return angles.cos(), angles.sin()
