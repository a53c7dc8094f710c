"""Timed training steps of the engine on the ranks of a benchmark (tools/bench_ddp.py,
tools/bench_moe.py): Adam at a constant learning rate over DDP-wrapped chunks, and the seconds
of each step on random tokens, every rank starting a step together."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from engine.config.optimizer import OptimizerConfig
from engine.optim.lr_schedule import LRScheduler
from engine.optim.optimizer import build_optimizer
from engine.train.step import train_step


def bench_optimizer(ddps, state, *, distributed: bool = False, experts_apart: bool = False):
    """(optimizer, scheduler): Adam at lr 1e-4, constant; `experts_apart`: the experts' own
    optimizer over the expert data-parallel group, as a run with EP > 1 builds it."""
    config = OptimizerConfig(lr=1e-4, lr_decay_style="constant")
    experts = (
        {"experts_apart": True, "expert_norm_group": state.expert_tp_ep_pp_group}
        if experts_apart
        else {}
    )
    optimizer = build_optimizer(
        ddps,
        config,
        use_distributed_optimizer=distributed,
        fp16=False,
        tp_rank=0,
        model_parallel_group=None,
        instance_group=state.optimizer_instance_group,
        device=state.device,
        **experts,
    )
    return optimizer, LRScheduler(config, 10**6)


def timed_steps(
    ddps,
    optimizer,
    scheduler,
    state,
    *,
    warmup: int,
    steps: int,
    micro_batch_size: int,
    seq_length: int,
    vocab_size: int,
    accumulation: int = 1,
    seed: int = 0,
) -> list[float]:
    """Seconds of each of `steps` training steps after `warmup` untimed ones, each step
    `accumulation` micro-batches of random tokens drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    several = dist.is_initialized() and dist.get_world_size() > 1
    times = []
    for step in range(warmup + steps):
        batches = []
        for _ in range(accumulation):
            shape = (micro_batch_size, seq_length + 1)
            tokens = torch.randint(0, vocab_size, shape, generator=generator)
            batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
        if several:
            dist.barrier()
        start = time.perf_counter()
        train_step(ddps, optimizer, scheduler, batches, state)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times
