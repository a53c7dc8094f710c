"""Checkpoints (`CheckpointConfig`): where a run saves and loads, how often, how many it keeps,
and what a load restores."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError

# megatron-core's StrictHandling values, in its order
STRICTNESS = (
    "assume_ok_unexpected",
    "log_unexpected",
    "log_all",
    "raise_unexpected",
    "raise_all",
    "return_unexpected",
    "return_all",
    "ignore_all",
)


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and loading checkpoints."""

    save: str | None = option(None, "checkpoint directory to save to")
    load: str | None = option(None, "checkpoint directory to resume from (its latest)")
    verify_checkpoint: bool = option(
        True,
        "load --load's checkpoint without comparing its files with the checksums recorded when "
        "they were written (sizes are still checked)",
        flag="--no-verify",
        action="store_false",
    )
    finetune: bool = option(
        False,
        "load only the model weights of --load: iteration, samples, optimizer, learning-rate "
        "schedule, data position and random state start afresh",
    )
    no_load_optim: bool = option(
        False,
        "resume without the optimizer state, loss scaler and learning-rate schedule (they "
        "start afresh, as in Megatron-LM); iteration and data position are kept",
    )
    no_load_rng: bool = option(False, "resume without the saved random state (re-seeded)")
    use_checkpoint_args: bool = option(
        False, "take the model's shape and style from the --load checkpoint, not the flags"
    )
    save_interval: int | None = option(
        None, "steps between checkpoints", aliases=("--persistent-save-interval",)
    )
    keep_last_n: int | None = option(None, "keep only the newest N checkpoints")
    exit_on_missing_checkpoint: bool = option(
        False, "with --load: stop, training nothing, when it holds no checkpoint"
    )
    save_retain_interval: int | None = option(
        None,
        "keep the checkpoints of iterations that are multiples of this and the newest one; "
        "the others are removed once a newer one is saved (as Megatron-LM)",
    )
    async_save: bool = option(False, "write checkpoints in the background")
    dist_ckpt_strictness: str = option(
        "assume_ok_unexpected",
        "a resume's answer to tensors the model has and the checkpoint lacks ('unexpected': "
        "stop, except log_* and ignore_all, which keep their initial values) and to tensors "
        "only the checkpoint has (skipped; log_all names them, raise_all stops)",
        choices=list(STRICTNESS),
    )

    def validate(self) -> None:
        if self.dist_ckpt_strictness.startswith("return_"):
            raise ConfigError(
                f"--dist-ckpt-strictness {self.dist_ckpt_strictness} hands the mismatching keys "
                "to a caller, which a training run does not have (Megatron-LM's training fails "
                "on it too); use log_unexpected, log_all, raise_unexpected or raise_all"
            )
        if self.save_retain_interval is not None and self.save_retain_interval < 1:
            raise ConfigError("--save-retain-interval must be at least 1 (or left out)")
        if self.save_interval is not None and self.save_interval < 1:
            raise ConfigError("--save-interval must be at least 1")
        if self.save_interval and not self.save:
            raise ConfigError("--save-interval needs --save DIR")
        if self.keep_last_n is not None and self.keep_last_n < 1:
            raise ConfigError("--keep-last-n must be at least 1")
