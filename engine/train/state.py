"""The state of a training run: its configs, counters, and the objects the loop works with."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.checkpoint.save import Checkpointer
from engine.config.batch_schedule import BatchSchedule
from engine.config.configs import Configs
from engine.config.runtime import RuntimeConfig
from engine.monitor.metrics import MetricsWriter, SpikeDetector, Throughput
from engine.monitor.profiler import StepProfiler
from engine.optim.lr_schedule import LRScheduler
from engine.train.exit_conditions import ExitConditions
from parallel.state import ParallelState


@dataclass
class Counters:
    """Run state that is not in the model or optimizer, saved in meta.json."""

    iteration: int = 0
    consumed_samples: int = 0
    consumed_valid_samples: int = 0  # evaluations read on through the valid split
    skipped_iters: int = 0
    nan_iters: int = 0
    optimizer_step: int = 0
    spike_history: list = field(default_factory=list)


@dataclass
class Run:
    """Everything the loop needs, built once by `setup`."""

    cfg: Configs
    state: ParallelState
    chunks: list
    optimizer: object
    scheduler: LRScheduler
    schedule: object
    tracker: object
    datasets: list
    counters: Counters
    batches: BatchSchedule
    dtype: torch.dtype
    writer: MetricsWriter
    checkpointer: Checkpointer | None
    checkpoint_group: object
    throughput: Throughput
    spikes: SpikeDetector
    last_saved: int | None = None
    exit_conditions: ExitConditions | None = None
    profiler: StepProfiler | None = None
    # Parquet streams: the position to resume from, and the training iterator whose position
    # a checkpoint saves.
    data_state: dict | None = None
    train_iterator: object = None
    valid_iterator: object = None  # Parquet streams: the valid stream, read on within a run
    norm_parts: object = None  # --log-grad-norms-interval: engine/monitor/grad_norm_parts.py
    local_squares: object = None  # --log-gradient-noise-scale: engine/monitor/noise_scale.py
    noise_scale: object = None
    times: object = None  # parallel.timing.StepTimes: where the steps' time goes
    eval_prompts: object = None  # --eval-prompts: engine/eval/samples.py EvalPrompts
    mix: object = None  # the train blend's weights over the run: engine/data/mix/schedule.py


def params_dtype(runtime: RuntimeConfig) -> torch.dtype:
    return torch.bfloat16 if runtime.bf16 else torch.float16 if runtime.fp16 else torch.float32


def layout_of(state: ParallelState, cfg: Configs) -> dict:
    layout = {
        "tp": state.tp_size,
        "pp": state.pp_size,
        "dp": state.dp_size,
        "virtual": cfg.parallel.virtual_size(cfg.model.num_layers),
        "distributed_optimizer": cfg.parallel.shards_optimizer(),
    }
    if state.cp_size > 1:  # absent at 1: layouts recorded before CP existed stay equal
        layout["cp"] = state.cp_size
    return layout


def logging_rank(state: ParallelState) -> bool:
    return state.is_last_stage and state.tp_rank == 0 and state.cp_rank == 0 and state.dp_rank == 0
