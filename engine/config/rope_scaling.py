"""The RoPE scaling the model flags ask for, read in one place (the tables are built by
engine/model/rope.py).

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
config.json's rope_parameters; the tables, the checks of ModelConfig and the Hugging Face and
Megatron-LM exports all use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import ConfigError


def rope_scaling_of(cfg) -> dict | None:
    """The RoPE scaling cfg asks for, as config.json's rope_parameters would hold it (without
    rope_theta), or None; ConfigError (one line) when two flags ask for different ones.
    Multi-latent attention's is its own (--rope-type, engine/config/latent_attention.py)."""
    if getattr(cfg, "multi_latent_attention", False):
        return cfg.latent_rope_scaling()
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

    def ramp_bounds(self, base: float, dim: int) -> tuple[float, float]:
        """The rotary dimensions between which frequencies blend from extrapolated to
        interpolated: where the original length makes beta_fast and beta_slow rotations."""

        def dimension_of(rotations: float) -> float:  # where the original length turns that often
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(base))

        low, high = dimension_of(self.beta_fast), dimension_of(self.beta_slow)
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        return low, high
