"""The training loop's settings (`TrainConfig`): batch sizes, length, precision,
evaluation, logging, checkpoints.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.config.batch_schedule import BatchSchedule, parse_step_schedule
from engine.config.fields import option
from engine.errors import ConfigError


@dataclass
class TrainConfig:
    """The training loop: batch sizes, length, precision, evaluation, logging, checkpoints."""

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
    bf16: bool = option(False, "bf16 parameters and activations, fp32 master weights and grads")
    fp16: bool = option(False, "fp16 with dynamic loss scaling, fp32 master weights and grads")
    tf32: bool = option(
        True,
        "on GPUs, fp32 matmuls run on TF32 tensor cores (torch's 'high' float32 matmul "
        "precision); --no-tf32 keeps them in full fp32",
        flag="--no-tf32",
        action="store_false",
    )
    torch_compile: bool = option(
        False,
        "compile each transformer layer's forward with torch.compile (off by default until "
        "measured on a GPU)",
    )
    grad_reduce_in_bf16: bool = option(
        False,
        "with --bf16: accumulate and reduce gradients in bf16 (half the traffic; default fp32); "
        "the update still runs in fp32",
    )
    eval_interval: int | None = option(
        None, "evaluate on the valid split every this many steps (default: only at the end)"
    )
    eval_iters: int = option(100, "global batches per evaluation")
    eval_prompts: str | None = option(
        None,
        "a text file of prompts, one a line: at each evaluation of the valid split, print and "
        "log a greedy and a sampled continuation of each (under the run's own layout)",
    )
    eval_max_new_tokens: int = option(32, "--eval-prompts: tokens generated per continuation")
    eval_temperature: float = option(0.8, "--eval-prompts: the sampled continuation's temperature")
    eval_top_p: float = option(0.95, "--eval-prompts: the sampled continuation's nucleus mass")
    log_interval: int = option(100, "steps between log lines")
    timing_log_level: int = option(
        0,
        "the time breakdown (time/* in the log) is always measured; from 1 on, the device is "
        "synchronised around each measured part so that GPU work is counted where it runs "
        "(adds synchronisations); 2 also times each tensor-parallel collective on a GPU "
        "(tp-comm, timed on CPU at any level; never under --torch-compile), giving up its "
        "overlap with the GEMMs",
        choices=(0, 1, 2),
    )
    log_gradient_noise_scale: bool = option(
        False,
        "log the gradient noise scale (McCandlish et al.'s B_simple, from each DP rank's own "
        "gradient norm and the reduced one, smoothed); needs DP >= 2",
    )
    log_grad_norms_interval: int | None = option(
        None,
        "every this many iterations, log the gradient norm of each layer, the embeddings, the "
        "final norm, the output layer and each optimizer parameter group",
    )
    log_jsonl: str | None = option(None, "append one JSON object per log line to this file")
    tensorboard_dir: str | None = option(None, "write TensorBoard scalars here")
    wandb_project: str | None = option(
        None,
        "log to this Weights & Biases project (needs wandb installed; WANDB_MODE=offline "
        "works without network)",
    )
    wandb_exp_name: str | None = option(None, "the wandb run's name")
    wandb_save_dir: str | None = option(None, "where wandb writes the run (default <--save>/wandb)")
    wandb_entity: str | None = option(None, "the wandb team or user to log under")
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
    save_interval: int | None = option(None, "steps between checkpoints")
    keep_last_n: int | None = option(None, "keep only the newest N checkpoints")
    async_save: bool = option(False, "write checkpoints in the background")
    exit_on_nan_count: int | None = option(
        None, "stop after this many steps with a NaN/Inf loss or gradient"
    )
    spike_zscore: float = option(6.0, "a loss this many std devs above the recent mean is a spike")
    spike_window: int = option(50, "steps of loss history for spike detection")
    skip_spike_batches: bool = option(False, "skip the update of a step whose loss spikes")
    exit_interval: int | None = option(None, "stop (after saving) when iteration % this == 0")
    exit_duration_in_mins: float | None = option(
        None,
        "stop (after saving) once the processes have run this many minutes; exit code 0 "
        "(0: no limit)",
    )
    exit_signal_handler: bool = option(
        False,
        "on SIGTERM (a preempted or time-limited Slurm job): finish the iteration, save, exit "
        "with code 0",
    )
    profile: bool = option(
        False,
        "profile iterations --profile-step-start to --profile-step-end: the CUDA profiler's "
        "capture range for nsys on a GPU, torch.profiler with --use-pytorch-profiler or on a "
        "CPU (a trace beside --tensorboard-dir)",
    )
    profile_step_start: int = option(10, "--profile: the iteration profiling starts at")
    profile_step_end: int = option(12, "--profile: the iteration profiling stops at")
    profile_ranks: list[int] = option([], "--profile: the ranks profiled (default: all)", nargs="*")
    use_pytorch_profiler: bool = option(
        False, "--profile with torch.profiler (a Chrome trace) also on a GPU"
    )
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    use_fused_kernels: bool | None = option(
        None,
        "fused CUDA kernels for norms, RoPE, SwiGLU and cross-entropy (default: on CUDA "
        "when they build; never on CPU)",
        action=argparse.BooleanOptionalAction,
    )
    transformer_impl: str = option(
        "local", "layer implementation", choices=["local", "transformer_engine"]
    )

    def validate(self) -> None:
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 contradict each other; pick one")
        if self.log_grad_norms_interval is not None and self.log_grad_norms_interval < 1:
            raise ConfigError("--log-grad-norms-interval must be positive (or left out)")
        if self.eval_max_new_tokens < 1 or self.eval_temperature <= 0:
            raise ConfigError("--eval-max-new-tokens must be >= 1 and --eval-temperature > 0")
        if not 0 < self.eval_top_p <= 1:
            raise ConfigError(f"--eval-top-p {self.eval_top_p} must be in (0, 1]")
        for name in ("micro_batch_size", "train_iters", "train_samples", "log_interval"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.eval_interval is not None and self.eval_interval < 1:
            raise ConfigError("--eval-interval must be at least 1")
        if self.save_interval is not None and self.save_interval < 1:
            raise ConfigError("--save-interval must be at least 1")
        if self.save_interval and not self.save:
            raise ConfigError("--save-interval needs --save DIR")
        if self.keep_last_n is not None and self.keep_last_n < 1:
            raise ConfigError("--keep-last-n must be at least 1")
        if self.eval_iters < 0:
            raise ConfigError("--eval-iters must be non-negative")

    def batch_schedule(self, dp: int, seq_length: int) -> BatchSchedule:
        """The global batch over the run (constant, ramped up, or by a step schedule)."""
        return BatchSchedule.from_config(self, dp, seq_length)

    def resolve_length(self, dp: int, seq_length: int) -> None:
        """Sets --train-iters from --train-samples (the steps that fit, as Megatron-LM counts
        them); ConfigError if the length is missing or contradictory."""
        schedule = self.batch_schedule(dp, seq_length)
        if self.train_samples is None:
            if self.train_iters is None:
                raise ConfigError(
                    "the length of training is missing: give --train-iters N or --train-samples N"
                )
            if self.rampup_batch_size is not None:
                raise ConfigError(
                    "--rampup-batch-size needs a run counted in samples (as in Megatron-LM): "
                    "give --train-samples instead of --train-iters"
                )
            return
        iters = schedule.iterations_for_samples(self.train_samples)
        if self.train_iters is not None and self.train_iters != iters:
            raise ConfigError(
                "--train-iters and --train-samples both give the length of training; give one"
            )
        if iters < 1:
            raise ConfigError(
                f"--train-samples {self.train_samples} is less than one global batch "
                f"({schedule.at(0)})"
            )
        self.train_iters = iters

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
