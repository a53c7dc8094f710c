"""Parameter groups, the optimizer, and learning-rate schedules.

No weight decay on biases and norm weights (every 1-D parameter). The optimizer is torch's
AdamW (fused on CUDA, foreach elsewhere) or apex's FusedAdam when asked for and importable,
wrapped by parallel.zero.DistributedOptimizer, which feeds it fp32 masters (sharded over DP
with --use-distributed-optimizer).
"""

from __future__ import annotations

import math

import torch

from engine.config import OptimizerConfig
from engine.errors import ConfigError
from parallel.grad_scaler import DynamicGradScaler
from parallel.zero import DistributedOptimizer


def no_weight_decay(param: torch.nn.Parameter) -> bool:
    return param.ndim == 1


def _make_inner(cfg: OptimizerConfig, device: torch.device):
    if cfg.optimizer == "sgd":
        return lambda groups: torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum)
    if cfg.apex_fused_adam:
        try:
            from apex.optimizers import FusedAdam
        except ImportError:
            raise ConfigError(
                "--apex-fused-adam: apex is not importable; install NVIDIA apex from source "
                "(not `pip install apex`, an unrelated package) or drop the flag"
            ) from None
        return lambda groups: FusedAdam(
            groups,
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            adam_w_mode=True,
        )
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return lambda groups: torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, **impl
    )


def build_optimizer(
    ddps,
    cfg: OptimizerConfig,
    *,
    use_distributed_optimizer: bool,
    fp16: bool,
    tp_rank: int,
    model_parallel_group,
    world_group,
    device: torch.device,
    dp_group=None,
) -> DistributedOptimizer:
    """The training optimizer over the DDP-wrapped model chunks."""
    scaler = None
    if fp16:
        scaler = DynamicGradScaler(
            initial_scale=cfg.initial_loss_scale,
            min_scale=cfg.min_loss_scale,
            growth_interval=cfg.loss_scale_window,
            hysteresis=cfg.hysteresis,
        )
    groups = [{"weight_decay": cfg.weight_decay}, {"weight_decay": 0.0}]
    return DistributedOptimizer(
        ddps,
        _make_inner(cfg, device),
        groups,
        lambda p: int(no_weight_decay(p)),
        shard=use_distributed_optimizer,
        clip_grad=cfg.clip_grad,
        grad_scaler=scaler,
        tp_rank=tp_rank,
        model_parallel_group=model_parallel_group,
        world_group=world_group,
    )


class LRScheduler:
    """Linear warm-up from 0 to lr, then decay to min_lr by `lr_decay_iters`:
    cosine, linear, constant, or WSD (constant, then a final decay of lr_wsd_decay_iters)."""

    def __init__(self, cfg: OptimizerConfig, train_iters: int):
        self.cfg = cfg
        cfg.validate(train_iters)
        self.decay_iters = cfg.lr_decay_iters or train_iters
        self.num_steps = 0

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        warmup, decay = cfg.lr_warmup_iters, self.decay_iters
        if warmup and step < warmup:
            return cfg.lr * (step + 1) / warmup
        if cfg.lr_decay_style == "constant":
            return cfg.lr
        if step >= decay:
            return cfg.min_lr
        span = cfg.lr - cfg.min_lr
        if cfg.lr_decay_style == "WSD":
            anneal_start = decay - cfg.lr_wsd_decay_iters
            if step < anneal_start:
                return cfg.lr
            ratio = (step - anneal_start) / cfg.lr_wsd_decay_iters
            factor = {
                "linear": 1.0 - ratio,
                "cosine": 0.5 * (math.cos(math.pi * ratio) + 1.0),
                "exponential": (2.0 * math.pow(0.5, ratio)) - 1.0,
                "minus_sqrt": 1.0 - math.sqrt(ratio),
            }[cfg.lr_wsd_decay_style]
            return cfg.min_lr + span * factor
        ratio = (step - warmup) / max(decay - warmup, 1)
        if cfg.lr_decay_style == "linear":
            return cfg.min_lr + span * (1.0 - ratio)
        return cfg.min_lr + span * 0.5 * (math.cos(math.pi * ratio) + 1.0)

    def step(self, optimizer: DistributedOptimizer) -> float:
        """Set the learning rate of the coming update and advance."""
        lr = self.lr_at(self.num_steps)
        optimizer.set_lr(lr)
        self.num_steps += 1
        return lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
