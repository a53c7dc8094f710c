"""Megatron-LM's learning-rate schedules (`LRScheduler`)."""

from __future__ import annotations

import math

from engine.config.optimizer import OptimizerConfig
from engine.errors import ConfigError
from parallel.data_parallel.optimizer import DistributedOptimizer

# WSD's final anneal: the share of (lr - min_lr) left at a fraction r of the way through it.
_WSD_ANNEAL = {
    "linear": lambda r: 1.0 - r,
    "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
    "exponential": lambda r: (2.0 * math.pow(0.5, r)) - 1.0,
    "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
}


class LRScheduler:
    """Megatron-LM's learning-rate schedule (megatron.core's OptimizerParamScheduler).

    Linear warm-up from --lr-warmup-init to --lr over --lr-warmup-iters updates (update 0 runs
    at the initial LR, update lr_warmup_iters at the peak), then down to --min-lr by
    --lr-decay-iters: constant (stays at --lr), linear, cosine, inverse-square-root, or WSD
    (stays at --lr, then anneals over the last --lr-wsd-decay-iters). Past the decay length
    every style but constant gives --min-lr. With --decoupled-lr, the word embeddings and the
    output layer follow the same shape from --lr-warmup-init to --decoupled-lr and down to
    --decoupled-min-lr (default --min-lr), as megatron-core's per-group max_lr and min_lr.

    `num_steps` counts successful updates and `num_samples` the samples they took. The trainer
    calls `advance` only after an update is applied, as Megatron-LM steps its scheduler only
    when `update_successful`: a skipped step (NaN/Inf, a loss spike, an fp16 overflow) leaves
    the schedule where it was.

    Megatron-LM's schedule counts samples, also when training by iterations: warm-up and decay
    lengths are iterations x (final) global batch, and each update adds the samples of its
    global batch (fewer during a batch-size ramp-up). The arithmetic here is in samples too,
    with the same operations in the same order: the values agree to the last bit.

    Its state holds, beside the counts, the schedule's shape under megatron-core's names (peak
    and final learning rate, warm-up and decay lengths in samples, decay style, weight decay
    and its increment): on resume a difference stops the run unless
    --override-opt_param-scheduler keeps the command line's or
    --use-checkpoint-opt_param-scheduler takes the checkpoint's (`load_state_dict`).
    """

    def __init__(
        self,
        cfg: OptimizerConfig,
        train_iters: int,
        global_batch_size: int = 1,
        train_samples: int | None = None,
    ):
        self.cfg = cfg
        cfg.validate(train_iters, train_samples, global_batch_size)
        self.warmup, self.decay, self.anneal = cfg.schedule_samples(
            train_iters, train_samples, global_batch_size
        )
        self.global_batch_size = global_batch_size
        self.decay_style = cfg.lr_decay_style
        self.weight_decay = cfg.weight_decay
        # kept in the state only: the learning rates come from cfg (as megatron-core's
        # parameter groups carry them), and the weight decay is constant here
        self.max_lr, self.min_lr = float(cfg.lr), cfg.min_lr
        self.wd_incr_steps = train_samples if train_samples else train_iters * global_batch_size
        self.wd_incr_style = "constant"
        self.num_steps = 0
        self.num_samples = 0

    def lr_at(self, step: int) -> float:
        """The learning rate of the update made after `step` successful ones of the final
        global batch."""
        return self.lr_after(step * self.global_batch_size)

    def lr_after(self, samples: int, decoupled: bool = False) -> float:
        """The learning rate of the update made after updates of `samples` samples in all
        (of the --decoupled-lr parameters with `decoupled`)."""
        cfg = self.cfg
        warmup, decay = self.warmup, self.decay
        peak, init, floor = float(cfg.lr), cfg.lr_warmup_init, cfg.min_lr
        if decoupled and cfg.decoupled_lr is not None:
            peak = float(cfg.decoupled_lr)
            floor = cfg.min_lr if cfg.decoupled_min_lr is None else cfg.decoupled_min_lr
        if warmup > 0 and samples <= warmup:
            return init + (peak - init) * float(samples) / float(warmup)
        style = self.decay_style
        if style == "constant":
            return peak
        if samples > decay:
            return floor
        if style == "inverse-square-root":
            # peak at the end of warm-up, then falling as 1/sqrt(samples), never below min_lr
            return max(floor, peak * max(warmup, 1) ** 0.5 / max(samples, 1) ** 0.5)
        ratio = float(samples - warmup) / float(decay - warmup)
        if style == "linear":
            coeff = 1.0 - ratio
        elif style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD
            anneal = self.anneal
            anneal_start = decay - anneal
            if samples <= anneal_start:
                coeff = 1.0
            else:
                coeff = _WSD_ANNEAL[cfg.lr_wsd_decay_style]((samples - anneal_start) / anneal)
        return floor + coeff * (peak - floor)

    @property
    def lr(self) -> float:
        """The learning rate of the coming update."""
        return self.lr_after(self.num_samples)

    def apply(self, optimizer: DistributedOptimizer) -> float:
        """Give the optimizer the learning rates of the coming update; return the main one
        (--lr's; the one logged, as Megatron-LM logs it)."""
        lr = self.lr
        optimizer.set_lr(lr, self.lr_after(self.num_samples, decoupled=True))
        optimizer.set_weight_decay(self.weight_decay)
        return lr

    def advance(self, samples: int | None = None) -> None:
        """Count one successful update (never a skipped one) of `samples` samples (default:
        the final global batch)."""
        self.num_steps += 1
        self.num_samples += self.global_batch_size if samples is None else samples

    def shape(self) -> dict:
        """The schedule's shape, under megatron-core's OptimizerParamScheduler names."""
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "lr_warmup_steps": self.warmup,
            "lr_decay_steps": self.decay,
            "lr_decay_style": self.decay_style,
            "start_wd": self.weight_decay,
            "end_wd": self.weight_decay,
            "wd_incr_steps": self.wd_incr_steps,
            "wd_incr_style": self.wd_incr_style,
        }

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "num_samples": self.num_samples, **self.shape()}

    def load_state_dict(
        self, state: dict, use_checkpoint: bool = False, override: bool = False, where: str = ""
    ) -> list[str]:
        """Resume the counts of `state` and compare its shape (absent from checkpoints older
        than the comparison; megatron-core's older names read as it reads them) with this
        run's, as megatron-core does: a difference is a ConfigError unless `override` (keep
        ours) or `use_checkpoint` (take the checkpoint's: warm-up, decay and weight decay act,
        and the learning rates stay the command line's, as megatron-core's parameter groups
        carry them, though the state keeps the checkpoint's as its does). Returns the names of
        the values that act and were taken from `state`."""
        state = {_NEW_NAMES.get(key, key): value for key, value in state.items()}
        where = where or "the checkpoint"
        self.num_steps = int(state["num_steps"])
        # checkpoints from before batch-size schedules counted steps of the final batch only
        self.num_samples = int(state.get("num_samples", self.num_steps * self.global_batch_size))
        differ = [
            key for key, value in self.shape().items() if key in state and state[key] != value
        ]
        if override or not differ:
            return []
        if not use_checkpoint:
            key, value = differ[0], self.shape()[differ[0]]
            unit = " samples" if key.endswith("_steps") else ""
            raise ConfigError(
                f"{_FLAG_OF[key]}: the schedule's {key} is {value}{unit} here and "
                f"{state[key]}{unit} in {where}; resume with the same value, or pass "
                "--override-opt_param-scheduler (this command line's schedule) or "
                "--use-checkpoint-opt_param-scheduler (the checkpoint's)"
            )
        style = state.get("lr_decay_style", self.decay_style)
        if style not in _STYLES:
            raise ConfigError(
                f"--use-checkpoint-opt_param-scheduler: {where} decays the learning rate by "
                f"{style!r}, which tripod lacks"
            )
        if style == "WSD" and self.anneal is None:
            raise ConfigError(
                f"--use-checkpoint-opt_param-scheduler: {where} decays by WSD, whose final "
                "decay length megatron-core does not save; give --lr-wsd-decay-iters (or "
                "-samples)"
            )
        if "start_wd" in state and state["start_wd"] != state["end_wd"]:
            raise ConfigError(
                f"--use-checkpoint-opt_param-scheduler: {where} changes the weight decay over "
                "the run (--start-weight-decay/--end-weight-decay), a weight-decay schedule "
                "tripod lacks; pass --override-opt_param-scheduler"
            )
        for key in differ:
            value = state[key]
            if key in ("start_wd", "end_wd"):
                self.weight_decay = value
            else:
                setattr(self, _ATTRIBUTE_OF[key], value)
        return [key for key in differ if key not in ("max_lr", "min_lr", "wd_incr_steps")]


_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
# megatron-core's older names for its state's keys
_NEW_NAMES = {
    "start_lr": "max_lr",
    "warmup_iter": "lr_warmup_steps",
    "warmup_steps": "lr_warmup_steps",
    "end_iter": "lr_decay_steps",
    "decay_steps": "lr_decay_steps",
    "decay_style": "lr_decay_style",
    "num_iters": "num_steps",
}
_ATTRIBUTE_OF = {
    "max_lr": "max_lr",
    "min_lr": "min_lr",
    "lr_warmup_steps": "warmup",
    "lr_decay_steps": "decay",
    "lr_decay_style": "decay_style",
    "wd_incr_steps": "wd_incr_steps",
    "wd_incr_style": "wd_incr_style",
}
_FLAG_OF = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction",
    "lr_decay_steps": "--lr-decay-iters/--lr-decay-samples (default: the run's length)",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay",
    "end_wd": "--weight-decay",
    "wd_incr_steps": "--train-iters/--train-samples",
    "wd_incr_style": "--weight-decay-incr-style",
}
