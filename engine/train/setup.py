"""Setting a training run up from its configs: model, optimizer, schedules, data, metrics,
checkpointing, and (with --load) the state of a checkpoint."""

from __future__ import annotations

import dataclasses
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from engine.checkpoint.save import Checkpointer
from engine.config.configs import SECTIONS, Configs
from engine.data.builder import (
    build_gpt_datasets,
    build_mock_datasets,
    build_streaming_datasets,
    data_format,
)
from engine.data.indexed.gpt_dataset import SPLIT_NAMES
from engine.data.mix.schedule import train_mix
from engine.data.tokenizers import build_tokenizer
from engine.errors import ConfigError
from engine.model.builder import build_model_chunks
from engine.monitor.grad_norm_parts import grad_norm_parts
from engine.monitor.metrics import (
    MetricsWriter,
    SpikeDetector,
    Throughput,
    device_peak_tflops,
    model_flops_per_token,
)
from engine.monitor.noise_scale import LocalGradSquares, NoiseScale
from engine.monitor.profiler import StepProfiler
from engine.monitor.wandb import WandbWriter
from engine.ops import agree_on_ops, select_ops
from engine.optim.lr_schedule import LRScheduler
from engine.optim.optimizer import build_optimizer
from engine.train.checkpoint import resume
from engine.train.exit_conditions import ExitConditions, earliest_start
from engine.train.state import Counters, Run, logging_rank, params_dtype
from parallel.data_parallel.ddp import DistributedDataParallel
from parallel.pipeline.schedules import get_schedule
from parallel.pipeline.tables import PLACEMENT
from parallel.random import model_parallel_seed
from parallel.state import ParallelState
from parallel.timing import StepTimes


def setup(cfg: Configs, state: ParallelState, started: float | None = None) -> Run:
    """Model, optimizer, data, and (with --load) the state of a checkpoint. `started`: when
    the process started (time.time()), from which --exit-duration-in-mins counts."""
    m, par = cfg.model, cfg.parallel
    started = earliest_start(
        time.time() if started is None else started, state.world_group, state.device
    )
    random.seed(cfg.training.seed)
    np.random.seed(cfg.training.seed % 2**32)
    if state.device.type == "cuda" and cfg.runtime.tf32:
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores for fp32 matmuls
    tracker = model_parallel_seed(
        cfg.training.seed, state.tp_rank, state.pp_rank, state.device, state.cp_rank
    )
    dtype = params_dtype(cfg.runtime)
    virtual = par.virtual_size(m.num_layers)
    ops = agree_on_ops(
        select_ops(state.device, cfg.runtime.use_fused_kernels), state.world_group, state.device
    )
    if state.rank == 0:
        print(f"ops: {ops.name}", flush=True)
    times = _step_times(cfg.logging, state.device)
    chunks = build_model_chunks(
        m,
        state,
        params_dtype=dtype,
        seed=cfg.training.seed,
        sequence_parallel=par.sequence_parallel,
        gradient_accumulation_fusion=par.gradient_accumulation_fusion,
        tracker=tracker,
        virtual_size=virtual,
        first_stage_layers=par.decoder_first_pipeline_num_layers,
        last_stage_layers=par.decoder_last_pipeline_num_layers,
        ops=ops,
        torch_compile=cfg.runtime.torch_compile,
        cp_comm_type=par.cp_comm_type,
        times=_tp_comm_times(times, cfg, state.device),
        placement=PLACEMENT.get(par.pipeline_schedule, "loop"),
    )
    ddps = [
        DistributedDataParallel(
            c,
            state.dp_cp_group,  # CP ranks hold the same weights: reduce and shard over both
            bucket_size=par.ddp_bucket_size,
            overlap_grad_reduce=par.overlap_grad_reduce,
            sharding=par.sharding_strategy(),
            overlap_param_gather=par.overlap_param_gather,
            grad_dtype=torch.bfloat16
            if cfg.runtime.bf16 and cfg.runtime.grad_reduce_in_bf16
            else torch.float32,
        )
        for c in chunks
    ]
    optimizer = build_optimizer(
        ddps,
        cfg.optimizer,
        use_distributed_optimizer=par.shards_optimizer(),
        fp16=cfg.runtime.fp16,
        tp_rank=state.tp_rank,
        model_parallel_group=state.model_parallel_group,
        world_group=state.world_group,
        device=state.device,
        dp_group=state.dp_cp_group,  # replicas agree on a non-finite gradient norm
    )
    batches = cfg.training.batch_schedule(state.dp_size, m.seq_length)
    global_batch = batches.final
    scheduler = LRScheduler(
        cfg.optimizer, cfg.training.train_iters, global_batch, cfg.training.train_samples
    )
    seq = m.seq_length // state.cp_size  # the activations a pipeline stage sends on
    if par.sequence_parallel and state.tp_size > 1:
        seq //= state.tp_size
    schedule = get_schedule(
        state,
        virtual_size=virtual,
        kind=par.pipeline_schedule,
        tensor_shape=(seq, cfg.training.micro_batch_size, m.hidden_size),
        dtype=dtype,
        overlap_p2p=par.overlap_p2p_communication,
        times=times,
    )
    mix = train_mix(cfg.data, cfg.training.train_iters, batches)
    datasets = _datasets(cfg, state, batches, mix if cfg.data.data_mix_schedule else None)
    flops = model_flops_per_token(m, m.padded_vocab_size(state.tp_size))
    peak, _ = device_peak_tflops(
        state.device, "bf16" if cfg.runtime.bf16 else "fp16" if cfg.runtime.fp16 else "fp32"
    )
    wandb = None
    if cfg.logging.wandb_project and logging_rank(state):
        wandb = WandbWriter(cfg.logging, cfg.checkpointing, run_record(cfg, state))
    writer = MetricsWriter(
        logging_rank(state), cfg.logging.log_jsonl, cfg.logging.tensorboard_dir, wandb
    )
    # Checkpoints talk over their own gloo group: an async save runs its collectives in a
    # background thread, which must never interleave with the training's collectives.
    checkpoint_group = None
    if state.world_size > 1:
        checkpoint_group = dist.new_group(list(range(state.world_size)), backend="gloo")
    checkpointer = None
    if cfg.checkpointing.save:
        checkpointer = Checkpointer(
            cfg.checkpointing.save,
            checkpoint_group,
            state.rank,
            cfg.checkpointing.async_save,
            cfg.checkpointing.keep_last_n,
        )
    run = Run(
        cfg,
        state,
        ddps,
        optimizer,
        scheduler,
        schedule,
        tracker,
        datasets,
        Counters(),
        batches,
        dtype,
        writer,
        checkpointer,
        checkpoint_group,
        Throughput(flops, state.world_size, peak),
        SpikeDetector(cfg.exit.spike_window, cfg.exit.spike_zscore),
        exit_conditions=ExitConditions(
            cfg.exit.exit_duration_in_mins, cfg.exit.exit_signal_handler, started=started
        ),
        profiler=StepProfiler(
            cfg.profiling,
            cfg.logging.tensorboard_dir,
            state.rank,
            state.device,
            optimizer.finish_param_sync,
        ),
        times=times,
        mix=mix,
    )
    if mix is not None and len(mix.phases) > 1:
        run.writer.print(mix.describe())
    if cfg.logging.log_gradient_noise_scale:
        run.local_squares = LocalGradSquares(ddps, state.tp_rank)
        run.noise_scale = NoiseScale()
    if cfg.logging.log_grad_norms_interval:
        decoupled = cfg.optimizer.decoupled_lr is not None
        run.norm_parts = grad_norm_parts(m, ddps, decoupled)
    if cfg.evaluation.eval_prompts:
        run.eval_prompts = _eval_prompts(cfg, state)
    if batches.describe():
        run.writer.print(batches.describe())
    if cfg.checkpointing.load:
        resume(run)
    if checkpointer is not None:
        checkpointer.prepare(ddps, optimizer, run.tracker)
    return run


def _step_times(logging, device) -> StepTimes:
    sync = None
    if logging.timing_log_level >= 1 and device.type == "cuda":
        sync = torch.cuda.synchronize  # GPU work counted where it runs, at a cost
    return StepTimes(sync)


def _tp_comm_times(times: StepTimes, cfg: Configs, device) -> StepTimes | None:
    """Where the layers count their tensor-parallel communication: always on CPU (gloo's
    collectives block, so host time is their time); on a GPU only at --timing-log-level 2,
    whose synchronisation around each collective gives up its overlap with the GEMMs (at lower
    levels a launch's host time would say nothing, and the time stays in forward and backward
    compute). Compiled layers are not timed inside."""
    compiled, level = cfg.runtime.torch_compile, cfg.logging.timing_log_level
    if compiled or (device.type == "cuda" and level < 2):
        return None
    return times


def run_record(cfg: Configs, state: ParallelState) -> dict:
    """The run's settings, as a flat record (the wandb run's config)."""
    record = {"world_size": state.world_size, "data_parallel_size": state.dp_size}
    for name, _, _ in SECTIONS:
        if name == "megatron":
            continue
        record.update(dataclasses.asdict(getattr(cfg, name)))
    return record


def split_sample_counts(cfg: Configs, global_batch: int) -> tuple[int, int, int]:
    """Samples asked of the train, valid and test splits, as Megatron-LM asks them (the sizes
    decide how many epochs each split spans, and so its order): the whole run; --eval-iters
    batches for each evaluation of the run and one more; --eval-iters batches."""
    training, evaluation = cfg.training, cfg.evaluation
    every = evaluation.eval_interval
    evaluations = training.train_iters // every + 1 if every else 1
    return (
        training.train_samples or training.train_iters * global_batch,
        evaluations * evaluation.eval_iters * global_batch,
        evaluation.eval_iters * global_batch,
    )


def _eval_prompts(cfg: Configs, state: ParallelState):
    """--eval-prompts read and tokenized (every rank: they decode together)."""
    from engine.eval.samples import EvalPrompts, read_prompts

    tokenizer = build_tokenizer(cfg.tokenizer)
    ids = read_prompts(cfg.evaluation.eval_prompts, tokenizer, cfg.model.seq_length)
    evaluation = cfg.evaluation
    return EvalPrompts(
        tokenizer,
        ids,
        evaluation.eval_max_new_tokens,
        evaluation.eval_temperature,
        evaluation.eval_top_p,
    )


def _datasets(cfg: Configs, state: ParallelState, batches, mix) -> list:

    global_batch = batches.final
    samples = split_sample_counts(cfg, global_batch)
    data = cfg.data
    tokenizer = build_tokenizer(cfg.tokenizer) if data.mock_data else None

    def build():
        paths = data.data_path or data.train_data_path
        if not data.mock_data and data_format(paths, data.data_format) == "parquet":
            return build_streaming_datasets(
                data.data_path,
                data.parquet_text_column,
                data.parquet_shuffle_buffer,
                data.split,
                cfg.model.seq_length,
                cfg.training.seed,
                samples,
                cfg.tokenizer,
            )
        if data.mock_data:
            return build_mock_datasets(
                tokenizer.vocab_size,
                tokenizer.eod,
                cfg.model.seq_length,
                cfg.training.seed,
                samples,
                data.data_cache_path,
            )
        return build_gpt_datasets(
            data.data_path,
            data.split,
            cfg.model.seq_length,
            cfg.training.seed,
            samples,
            data.data_cache_path,
            data.per_split_paths,
            mix,
        )

    # Rank 0 builds the index caches (indexed and mock data); the others then load them.
    if state.rank == 0:
        datasets = build()
    if state.world_group is not None:
        dist.barrier(group=state.world_group)
    if state.rank != 0:
        datasets = build()
    if datasets[0] is None:
        raise ConfigError(f"--split {data.split} leaves no training documents")
    _, consumed = batches.sizes(
        cfg.training.train_iters
    )  # a ramp's last step may pass --train-samples
    needs = (max(samples[0], consumed), samples[1], samples[2])
    for name, dataset, needed in zip(SPLIT_NAMES, datasets, needs):
        if dataset is not None and len(dataset) < needed:
            raise ConfigError(
                f"the {name} split has {len(dataset)} samples and the run needs {needed}: "
                "prefixes given alone (--data-path A B) blend one epoch of each; give weights "
                "(0.5 A 0.5 B) to repeat them, or train for less"
            )
    return datasets
