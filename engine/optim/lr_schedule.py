"""Megatron-LM's learning-rate schedules (`LRScheduler`)."""

from __future__ import annotations

import math

from engine.config.optimizer import OptimizerConfig
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
        if cfg.lr_decay_style == "constant":
            return peak
        if samples > decay:
            return floor
        if cfg.lr_decay_style == "inverse-square-root":
            # peak at the end of warm-up, then falling as 1/sqrt(samples), never below min_lr
            return max(floor, peak * max(warmup, 1) ** 0.5 / max(samples, 1) ** 0.5)
        ratio = float(samples - warmup) / float(decay - warmup)
        if cfg.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif cfg.lr_decay_style == "cosine":
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
        return lr

    def advance(self, samples: int | None = None) -> None:
        """Count one successful update (never a skipped one) of `samples` samples (default:
        the final global batch)."""
        self.num_steps += 1
        self.num_samples += self.global_batch_size if samples is None else samples

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        # checkpoints from before batch-size schedules counted steps of the final batch only
        self.num_samples = int(state.get("num_samples", self.num_steps * self.global_batch_size))
