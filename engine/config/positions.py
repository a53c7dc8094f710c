"""How the model encodes positions (`PositionOptions`, which `ModelConfig` extends): learned
absolute positions or RoPE, and RoPE's scalings with Megatron-LM's flags (read in one place by
engine/config/rope_scaling.py), and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError


@dataclass(frozen=True)
class PositionOptions:
    """Position encoding: learned absolute, RoPE and its scalings."""

    position_embedding_type: str = option(
        "learned_absolute",
        "position encoding (yarn: RoPE with YaRN scaling, Megatron-LM's spelling)",
        choices=["learned_absolute", "rope", "yarn"],
        switches={"--use-rotary-position-embeddings": "rope"},
    )
    rotary_base: int = option(10000, "RoPE base (theta)")
    rotary_interleaved: bool = option(
        False,
        "RoPE rotates adjacent channel pairs (0, 1), (2, 3), ... instead of channel i with "
        "i + d/2 (as Megatron-LM)",
    )
    use_rope_scaling: bool = option(
        False, "Llama 3.x RoPE scaling: low frequencies slowed by --rope-scaling-factor"
    )
    rope_scaling_factor: float = option(8.0, "with --use-rope-scaling: the scaling factor")
    rope_scaling_low_freq_factor: float = option(
        1.0, "with --use-rope-scaling: wavelengths above original length / this are scaled"
    )
    rope_scaling_high_freq_factor: float = option(
        4.0, "with --use-rope-scaling: wavelengths below original length / this are kept"
    )
    rope_scaling_original_max_position_embeddings: int = option(
        8192, "with --use-rope-scaling: the context length the model was first trained at"
    )
    rotary_seq_len_interpolation_factor: float | None = option(
        None, "linear RoPE scaling (position interpolation): positions divided by this"
    )
    rope_scaling_type: str | None = option(
        None,
        "RoPE scaling by Hugging Face's rope_type name, with --rope-scaling-factor (and, for "
        "llama3 and yarn, --rope-scaling-original-max-position-embeddings): llama3 (as "
        "--use-rope-scaling), linear, dynamic (NTK: the base grows with a sequence longer "
        "than --max-position-embeddings), yarn",
        choices=["llama3", "linear", "dynamic", "yarn"],
    )
    rotary_scaling_factor: float = option(
        1.0,
        "the YaRN scaling factor (with --position-embedding-type yarn, or in multi-latent "
        "attention, whose --rope-type is yarn by default)",
    )
    yarn_original_max_position_embeddings: int | None = option(
        None, "YaRN: the length first trained at (default 4096)"
    )
    yarn_beta_fast: float | None = option(None, "YaRN: rotations where extrapolation ends (32)")
    yarn_beta_slow: float | None = option(None, "YaRN: rotations where interpolation starts (1)")
    mscale: float = option(1.0, "YaRN: the attention scale's log(factor) coefficient / 0.1")
    mscale_all_dim: float = option(0.0, "YaRN: the same for its denominator (0: none)")
    yarn_correction_range_round_to_int: bool = option(
        True,
        "YaRN: keep the correction range's ends unrounded",
        flag="--no-yarn-correction-range-round-to-int",
        action="store_false",
        switches={"--yarn-correction-range-round-to-int": True},
    )
    rotary_percent: float = option(
        1.0, "the share of each head's channels RoPE rotates (the first ones); the rest pass"
    )

    @property
    def rotary_dim(self) -> int:
        """Channels of a head that RoPE rotates (as Megatron-LM: int(head size x percent));
        multi-latent attention's own rotated channels (--qk-pos-emb-head-dim)."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.head_dim * self.rotary_percent)

    @property
    def uses_rope(self) -> bool:
        """Rotary positions (rope, or yarn: RoPE with YaRN scaling)."""
        return self.position_embedding_type in ("rope", "yarn")

    def validate_positions(self) -> None:
        """ConfigError naming the flag for an impossible RoPE setting."""
        scaled = self.use_rope_scaling or self.rotary_seq_len_interpolation_factor
        if (scaled or self.rope_scaling_type) and not self.uses_rope:
            raise ConfigError(
                "--use-rope-scaling, --rotary-seq-len-interpolation-factor and "
                "--rope-scaling-type scale RoPE; add --position-embedding-type rope"
            )
        if self.use_rope_scaling and (
            self.rope_scaling_factor < 1
            or not 0 < self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor
        ):
            raise ConfigError(
                "--use-rope-scaling needs --rope-scaling-factor >= 1 and 0 < "
                "--rope-scaling-low-freq-factor < --rope-scaling-high-freq-factor"
            )
        if (self.rotary_seq_len_interpolation_factor or 1) < 1:
            raise ConfigError("--rotary-seq-len-interpolation-factor must be at least 1")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(f"--rotary-percent {self.rotary_percent} must be in (0, 1]")
        plain_rope = self.uses_rope and not self.multi_latent_attention  # MLA checks its own
        if plain_rope and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ConfigError(
                f"RoPE needs an even number of rotated channels per head, got {self.rotary_dim} "
                f"(head size {self.head_dim} x --rotary-percent {self.rotary_percent})"
            )
