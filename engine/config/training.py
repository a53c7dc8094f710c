"""How long a run trains and on what batches (`TrainingConfig`): micro-batch, global batch and
its ramp-up or schedule, the length in iterations or samples, the seed."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.batch_schedule import BatchSchedule, parse_step_schedule
from engine.config.fields import option
from engine.errors import ConfigError


@dataclass(frozen=True)
class TrainingConfig:
    """The run's length and batches."""

    micro_batch_size: int = option(
        4, "samples per micro-batch per data-parallel rank", required=True
    )
    global_batch_size: int | None = option(
        None, "samples per optimizer step (default: micro-batch x data-parallel size)"
    )
    rampup_batch_size: list[int] | None = option(
        None,
        "START INCREMENT SAMPLES: begin with global batch START and grow it by INCREMENT in "
        "equal intervals over the first SAMPLES samples up to --global-batch-size (with "
        "--train-samples)",
        nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"),
    )
    step_batch_size_schedule: list[str] | None = option(
        None,
        'global batch by tokens consumed: "0:16 2.4B:320 ..." (K/M/B/T suffixes; one quoted '
        "argument or several, as a script's word splitting passes it); the last batch is the "
        "--global-batch-size",
        nargs="+",
    )
    train_iters: int | None = option(None, "optimizer steps to train for (or --train-samples)")
    train_samples: int | None = option(
        None, "samples to train for (instead of --train-iters): global-batch steps that fit"
    )
    seed: int = option(1234, "random seed (initialisation, data order, dropout)")
    iterations_to_skip: list[int] = option(
        [],
        "steps skipped with their data, as Megatron-LM counts them: N skips the step that "
        "follows N completed ones (logged as iteration N+1); its global batch is read and "
        "dropped, nothing is trained and the learning rate does not move",
        nargs="+",
    )
    calculate_per_token_loss: bool = option(
        False,
        "the loss is the global batch's summed token losses over its count of tokens that "
        "carry loss (default: each micro-batch's mean, averaged)",
    )

    def validate(self) -> None:
        if any(k < 0 for k in self.iterations_to_skip):
            raise ConfigError(
                "--iterations-to-skip: give iteration numbers of 0 or more (N skips the step "
                "after N completed ones)"
            )
        for name in ("micro_batch_size", "train_iters", "train_samples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")

    def batch_schedule(self, dp: int, seq_length: int) -> BatchSchedule:
        """The global batch over the run (constant, ramped up, or by a step schedule)."""
        return BatchSchedule.from_config(self, dp, seq_length)

    def num_microbatches(self, dp: int, global_batch: int | None = None) -> int:
        """Micro-batches per step per DP rank (of the final global batch unless one is given);
        ConfigError if the global batch does not split."""
        global_batch = global_batch or self.global_batch(dp)
        if global_batch % (self.micro_batch_size * dp):
            raise ConfigError(
                f"global batch {global_batch} is not divisible by micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {dp}"
            )
        return global_batch // (self.micro_batch_size * dp)

    def global_batch(self, dp: int) -> int:
        """The global batch after any ramp-up or step schedule (--global-batch-size)."""
        if self.global_batch_size:
            return self.global_batch_size
        if self.step_batch_size_schedule is not None:
            return parse_step_schedule(self.step_batch_size_schedule, 1)[-1][1]
        return self.micro_batch_size * dp
