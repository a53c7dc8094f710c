"""The state of a training run: what the loop works with (`Run`, built once by
engine/train/setup.py and not changed after) and what changes as it goes (`Progress`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.checkpoint.save import Checkpointer
from engine.config.batch_schedule import BatchSchedule
from engine.config.configs import Configs
from engine.config.runtime import RuntimeConfig
from engine.data.documents import Packing
from engine.data.mix.schedule import MixSchedule
from engine.data.split import TrainingSplit
from engine.eval.samples import EvalPrompts
from engine.eval.tasks_in_training import EvalTasks
from engine.monitor.heartbeat import Heartbeat
from engine.monitor.metrics import MetricsWriter, SpikeDetector, Throughput
from engine.monitor.profiler import StepProfiler
from engine.monitor.stragglers import StragglerMonitor
from engine.optim.lr_schedule import LRScheduler
from engine.train.exit_conditions import ExitConditions
from engine.train.loss import LossReduction
from engine.train.step import StepFeatures
from parallel.data_parallel.ddp import DistributedDataParallel
from parallel.data_parallel.optimizer import DistributedOptimizer
from parallel.hang_watchdog import HangWatchdog
from parallel.random import RNGStatesTracker
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


@dataclass
class Progress:
    """What changes while a run goes on: its counters, its random streams (re-seeded when a
    checkpoint's cannot be restored), the last iteration saved, and the data's position."""

    tracker: RNGStatesTracker
    counters: Counters = field(default_factory=Counters)
    last_saved: int | None = None
    weights_checked: int | None = None  # the iteration whose weights were last found finite
    data_state: dict | None = None  # Parquet streams: the position to resume from
    train_iterator: Iterator[dict] | None = None  # whose position a checkpoint saves
    valid_iterator: Iterator[dict] | None = None  # Parquet streams: read on within a run
    # engine/train/data_skips.py's DataWindows: applied (kept in checkpoints) and still to come
    last_train_loss: float | None = None  # the last log window's, for the train/valid gap
    skipped_data: list = field(default_factory=list)
    pending_skips: list = field(default_factory=list)


@dataclass(frozen=True)
class Run:
    """Everything the loop works with, built once by engine/train/setup.py."""

    cfg: Configs
    state: ParallelState
    chunks: list[DistributedDataParallel]  # one per virtual pipeline stage of this rank
    optimizer: DistributedOptimizer
    scheduler: LRScheduler
    schedule: Callable[..., list[torch.Tensor]]  # parallel/pipeline/schedules.get_schedule's
    eval_schedule: Callable[..., list[torch.Tensor]]  # the same, or for the eval micro-batch
    datasets: list[TrainingSplit | None]  # [train, valid, test]; None: a split without samples
    batches: BatchSchedule
    dtype: torch.dtype
    writer: MetricsWriter
    checkpointer: Checkpointer | None  # None without --save
    checkpoint_group: dist.ProcessGroup | None
    throughput: Throughput
    spikes: SpikeDetector
    exit_conditions: ExitConditions
    profiler: StepProfiler
    features: StepFeatures
    progress: Progress
    eval_prompts: EvalPrompts | None = None  # --eval-prompts
    eval_tasks: EvalTasks | None = None  # --eval-tasks
    mix: MixSchedule | None = None  # the train blend's weights over the run
    packing: Packing | None = None  # what the samples' EOD tokens change (the three flags)
    loss_reduction: LossReduction = field(default_factory=LossReduction)  # per token or not
    tokenizer_identity: str | None = None  # Tokenizer.identity(), kept in every checkpoint
    watchdog: HangWatchdog | None = None  # --hang-timeout-seconds
    stragglers: StragglerMonitor | None = None  # --log-straggler
    heartbeat: Heartbeat | None = None  # --heartbeat-dir, on the first rank of each node
    record: dict = field(default_factory=dict)  # engine/train/run_record.py, in each checkpoint
    train_split_samples: int | None = None  # the train split's size, kept in checkpoints


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
    if state.ep_size > 1:  # (as CP)
        layout["ep"] = state.ep_size
    if state.pp_inside_dp:  # another rank order: each global rank's saved RNG is another's
        layout["rank_order"] = "tp-cp-pp-dp"
    return layout


def logging_rank(state: ParallelState) -> bool:
    return state.is_last_stage and state.tp_rank == 0 and state.cp_rank == 0 and state.dp_rank == 0
