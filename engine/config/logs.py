"""What a run logs and where (`LoggingConfig`): the log interval, the time breakdown, gradient
norms and noise scale, JSONL, TensorBoard and Weights & Biases."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError


@dataclass(frozen=True)
class LoggingConfig:
    """The log lines, the extra measurements and the metrics writers."""

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
    log_gradient_cosine_interval: int | None = option(
        None,
        "every this many iterations, log the cosine similarity of the gradients of every pair "
        "of the training blend's datasets (whole model and per layer group; > 0 transfer, ~0 "
        "neutral, < 0 interference), from the step's own micro-batches: one more forward and "
        "backward per dataset present",
    )
    log_update_to_weight_ratios: bool = option(
        False,
        "at each log line's iteration, log |update| / |weight| of each layer group (the groups "
        "of --log-grad-norms-interval; update_ratio/<group>); holds two more copies of the "
        "rank's fp32 weights (before, and the update) during that step",
    )
    log_activation_stats: bool = option(
        False,
        "at each log line's iteration, log the RMS and the largest magnitude of each "
        "transformer layer's output over the global batch (act_rms/layers.N, act_max/layers.N)",
    )
    log_params_norm: bool = option(
        False, "log the parameters' L2 norm after each update (params_norm; as Megatron-LM)"
    )
    log_num_zeros_in_grad: bool = option(
        False, "log how many gradient elements are zero (num_zeros; as Megatron-LM)"
    )
    moe_per_layer_logging: bool = option(
        False,
        "a mixture of experts: also log each MoE layer's losses (moe/<loss>_layer_<n>, as "
        "Megatron-LM) and load imbalance (moe/load_imbalance_layer_<n>)",
    )
    log_memory_to_tensorboard: bool = option(
        False,
        "add the CUDA allocator's mem-reserved-bytes, mem-allocated-bytes, "
        "mem-max-allocated-bytes and mem-allocated-count to TensorBoard and each log record "
        "(as Megatron-LM; nothing on a CPU)",
    )
    logging_level: int | None = option(
        None,
        "the Python logging level of every logger (10 debug, 20 info, 30 warning; default: "
        "the MEGATRON_LOGGING_LEVEL environment variable, else Python's)",
    )
    log_jsonl: str | None = option(None, "append one JSON object per log line to this file")
    tensorboard_dir: str | None = option(None, "write TensorBoard scalars here")
    tensorboard_queue_size: int = option(
        1000, "TensorBoard events held in memory before they are written to --tensorboard-dir"
    )
    tensorboard_log_interval: int = option(
        1,
        "write the loss, learning rate, batch size, loss scale, gradient and parameter norms, "
        "zeros and memory to TensorBoard every this many iterations, each iteration's own "
        "value (as Megatron-LM); the window's rates and times go with the log line",
    )
    wandb_project: str | None = option(
        None,
        "log to this Weights & Biases project (needs wandb installed; WANDB_MODE=offline "
        "works without network)",
    )
    wandb_exp_name: str | None = option(None, "the wandb run's name")
    wandb_save_dir: str | None = option(None, "where wandb writes the run (default <--save>/wandb)")
    wandb_entity: str | None = option(None, "the wandb team or user to log under")

    def validate(self) -> None:
        if self.log_grad_norms_interval is not None and self.log_grad_norms_interval < 1:
            raise ConfigError("--log-grad-norms-interval must be positive (or left out)")
        every = self.log_gradient_cosine_interval
        if every is not None and every < 1:
            raise ConfigError("--log-gradient-cosine-interval must be positive (or left out)")
        if self.log_interval < 1:
            raise ConfigError("--log-interval must be at least 1")
        if self.tensorboard_queue_size < 1:
            raise ConfigError("--tensorboard-queue-size must be at least 1")
        if self.tensorboard_log_interval < 1:
            raise ConfigError("--tensorboard-log-interval must be at least 1")
