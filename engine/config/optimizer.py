"""The optimizer, learning-rate schedule, clipping and loss scaling (`OptimizerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import option
from engine.config.muon import MuonOptions
from engine.errors import ConfigError

# A learning rate above this is a typo: one update makes the weights useless (above float32's
# 3.4e38 torch's optimizers cannot even hold it).
LARGEST_LR = 1e30


@dataclass(frozen=True)
class OptimizerConfig(MuonOptions):
    """Optimizer, learning-rate schedule, clipping and loss scaling."""

    optimizer: str = option(
        "adam",
        "optimizer: adam (AdamW-style decoupled decay), sgd, or muon (Muon for the 2-D hidden "
        "weights, Adam for the rest; dist_muon: muon with --use-distributed-optimizer)",
        choices=["adam", "sgd", "muon", "dist_muon"],
    )
    lr: float = option(3e-4, "peak learning rate")
    min_lr: float = option(0.0, "learning rate at the end of the decay")
    decoupled_lr: float | None = option(
        None,
        "peak learning rate of the word embeddings and the output layer (default --lr); the "
        "same warm-up and decay",
    )
    decoupled_min_lr: float | None = option(
        None, "with --decoupled-lr: their learning rate at the end of the decay (default --min-lr)"
    )
    lr_decay_style: str = option(
        "linear",
        "decay after warm-up",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    )
    lr_decay_iters: int | None = option(
        None,
        "iterations to decay the learning rate over, warm-up included (default: --train-iters)",
    )
    lr_decay_samples: int | None = option(
        None, "with --train-samples: samples to decay over (default: --train-samples)"
    )
    lr_warmup_iters: int = option(0, "iterations of linear warm-up from --lr-warmup-init")
    lr_warmup_samples: int = option(0, "with --train-samples: samples of linear warm-up")
    lr_warmup_fraction: float | None = option(
        None, "warm-up as this fraction of the decay length (instead of --lr-warmup-iters/samples)"
    )
    lr_warmup_init: float = option(0.0, "learning rate of the first warm-up update")
    lr_wsd_decay_style: str = option(
        "exponential",
        "WSD: shape of the final decay",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
    )
    lr_wsd_decay_iters: int | None = option(None, "WSD: iterations of the final decay")
    lr_wsd_decay_samples: int | None = option(
        None, "WSD with --train-samples: samples of the final decay"
    )
    weight_decay: float = option(0.01, "decoupled weight decay (not on biases and norms)")
    use_checkpoint_opt_param_scheduler: bool = option(
        False,
        "on resume, take the warm-up, decay length and style and the weight decay from the "
        "checkpoint (--lr and --min-lr stay the command line's, as in megatron-core)",
        aliases=("--use-checkpoint-opt_param-scheduler",),
    )
    override_opt_param_scheduler: bool = option(
        False,
        "on resume, keep the command line's schedule even where the checkpoint's differs "
        "(without either flag a difference stops the run)",
        aliases=("--override-opt_param-scheduler",),
    )
    adam_beta1: float = option(0.9, "Adam beta1")
    adam_beta2: float = option(0.999, "Adam beta2")
    adam_eps: float = option(1e-8, "Adam epsilon")
    sgd_momentum: float = option(0.9, "SGD momentum")
    clip_grad: float = option(1.0, "clip the global gradient norm to this (0: off)")
    pcgrad: bool = option(
        False,
        "gradient surgery across the training blend's datasets (PCGrad, Yu et al. 2020): each "
        "dataset's gradient is projected off the others' where they conflict, in a random "
        "order seeded by the step, and the projected gradients are summed into the step's; "
        "one more forward and backward per dataset present, at every step",
    )
    apex_fused_adam: bool = option(False, "use apex's FusedAdam (needs apex importable)")
    initial_loss_scale: float = option(2.0**32, "fp16: initial dynamic loss scale")
    min_loss_scale: float = option(1.0, "fp16: the loss scale never goes below this")
    loss_scale_window: int = option(1000, "fp16: clean steps before the scale doubles")
    hysteresis: int = option(2, "fp16: overflowing steps in a row before the scale halves")

    def schedule_samples(
        self, train_iters: int | None, train_samples: int | None = None, global_batch: int = 1
    ) -> tuple[float, int, int | None]:
        """(warm-up, decay, WSD anneal) lengths in samples, as Megatron-LM derives them: from
        the iteration flags times the global batch when training by iterations, from the
        sample flags when training by --train-samples; --lr-warmup-fraction takes that share of
        the decay length (so the warm-up may be a fraction of a sample)."""
        if train_samples:
            decay = self.lr_decay_samples if self.lr_decay_samples is not None else train_samples
            wsd = self.lr_wsd_decay_samples
            warmup = self.lr_warmup_samples
        else:
            decay_iters = self.lr_decay_iters if self.lr_decay_iters is not None else train_iters
            decay = (decay_iters or 0) * global_batch
            wsd = (
                None if self.lr_wsd_decay_iters is None else self.lr_wsd_decay_iters * global_batch
            )
            warmup = self.lr_warmup_iters * global_batch
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        return warmup, decay, wsd

    def validate(
        self, train_iters: int | None = None, train_samples: int | None = None, global_batch=1
    ) -> None:
        # The bounds megatron.core's OptimizerParamScheduler and Megatron-LM's argument checks
        # assert, as flag errors.
        by_samples = bool(train_samples)
        unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
        wrong = {
            "iters": (self.lr_decay_iters, self.lr_warmup_iters or None, self.lr_wsd_decay_iters),
            "samples": (
                self.lr_decay_samples,
                self.lr_warmup_samples or None,
                self.lr_wsd_decay_samples,
            ),
        }[other]
        for name, value in zip(("decay", "warmup", "wsd-decay"), wrong, strict=False):
            if value is not None:
                raise ConfigError(
                    f"--lr-{name}-{other} goes with --train-{other}, but the run is counted in "
                    f"{unit} (--train-{unit}); use --lr-{name}-{unit}"
                )
        if self.use_checkpoint_opt_param_scheduler and self.override_opt_param_scheduler:
            raise ConfigError(
                "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler ask for "
                "the command line's and the checkpoint's schedule; give one"
            )
        if self.lr_warmup_fraction is not None and (self.lr_warmup_iters or self.lr_warmup_samples):
            raise ConfigError(
                "--lr-warmup-fraction and --lr-warmup-iters/samples both set the warm-up; give one"
            )
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction < 1:
            raise ConfigError("--lr-warmup-fraction must be in [0, 1)")
        for name in ("lr_decay_iters", "lr_decay_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.lr_warmup_iters < 0 or self.lr_warmup_samples < 0:
            raise ConfigError(f"--lr-warmup-{unit} must be non-negative")
        warmup, decay, _ = self.schedule_samples(train_iters, train_samples, global_batch)
        if (train_iters or train_samples) and warmup >= decay:
            if self.lr_warmup_fraction is not None:
                given = f"--lr-warmup-fraction {self.lr_warmup_fraction}"
            else:
                given = f"--lr-warmup-{unit} {getattr(self, f'lr_warmup_{unit}')}"
            raise ConfigError(
                f"the warm-up ({given}) must be shorter than the decay length (--lr-decay-{unit}, "
                f"default --train-{unit}); lower it or raise the decay length"
            )
        for flag, value in (("--lr", self.lr), ("--decoupled-lr", self.decoupled_lr)):
            if value is not None and value > LARGEST_LR:
                raise ConfigError(
                    f"{flag} {value:g} is beyond any usable learning rate (at most 1e30); give one "
                    "such as 1e-4"
                )
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr})")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ConfigError("--decoupled-min-lr goes with --decoupled-lr; give both or neither")
        if self.decoupled_lr is not None:
            floor = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            if self.decoupled_lr < 0 or floor < 0 or floor > self.decoupled_lr:
                raise ConfigError(
                    f"need 0 <= --decoupled-min-lr (default --min-lr; {floor}) <= --decoupled-lr "
                    f"({self.decoupled_lr})"
                )
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ConfigError(f"need 0 <= --lr-warmup-init ({self.lr_warmup_init}) <= --lr")
        if self.clip_grad < 0:
            raise ConfigError("--clip-grad must be non-negative (0 turns clipping off)")
        wsd = self.lr_wsd_decay_samples if by_samples else self.lr_wsd_decay_iters
        if self.lr_decay_style == "WSD" and (wsd or 0) < 1:
            raise ConfigError(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} (at least 1)")
