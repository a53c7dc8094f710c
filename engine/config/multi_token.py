"""The multi-token-prediction part of the model's config (`MultiTokenOptions`, which
`ModelConfig` extends): DeepSeek-V3's extra prediction depths, with Megatron-LM's flag names,
meanings and defaults (megatron-core 0.16.1), and their checks.

Depth k (1..D) combines each position's hidden state from depth k-1 (the decoder's output,
after its final norm, for k = 1) with the embedding of the token k places ahead, runs one more
transformer layer and predicts the token k+1 places ahead through the shared output layer; the
mean of the D depths' losses times --mtp-loss-scaling-factor joins the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError


@dataclass(frozen=True)
class MultiTokenOptions:
    """Multi-token prediction (MTP)."""

    mtp_num_layers: int | None = option(
        None,
        "multi-token prediction: this many extra layers, depth k predicting the token k+1 "
        "places ahead (DeepSeek-V3: 1); they sit on the last pipeline stage and share its "
        "embedding and output layer",
    )
    mtp_loss_scaling_factor: float = option(
        0.1, "multi-token prediction: the weight of the mean of its depths' losses"
    )

    @property
    def mtp_depths(self) -> int:
        return self.mtp_num_layers or 0

    def validate_multi_token(self) -> None:
        """ConfigError naming the flag for what multi-token prediction cannot take."""
        if self.mtp_num_layers is None:
            return
        if self.mtp_num_layers < 1:
            raise ConfigError(
                f"--mtp-num-layers {self.mtp_num_layers} must be at least 1 (or left out)"
            )
        if not self.uses_rope:
            raise ConfigError(
                f"--mtp-num-layers with --position-embedding-type {self.position_embedding_type}"
                ": as Megatron-LM, multi-token prediction needs rotary positions (rope)"
            )
        if self.window_attn_skip_freq is not None:
            raise ConfigError(
                "--mtp-num-layers with --window-attn-skip-freq: which of its layers slide is not "
                "defined here; drop one"
            )
