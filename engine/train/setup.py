"""Setting a training run up from its resolved configs: model, optimizer, schedule, data,
metrics, checkpointing, the optional per-step measurements, and (with --load) the state of a
checkpoint."""

from __future__ import annotations

import functools
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from engine.checkpoint.files import find_latest, iteration_dir, read_meta
from engine.checkpoint.save import Checkpointer
from engine.config.configs import Configs
from engine.data.documents import Packing
from engine.data.mix.schedule import train_mix
from engine.data.sources import sources_of
from engine.data.tokenizers import build_tokenizer
from engine.errors import UserError
from engine.eval.loading import plain_tokenizer
from engine.eval.samples import EvalPrompts, read_prompts
from engine.eval.tasks_in_training import EvalTasks, read_tasks
from engine.model.builder import build_model_chunks
from engine.monitor.activation_stats import ActivationStats
from engine.monitor.grad_norm_parts import grad_norm_parts
from engine.monitor.heartbeat import Heartbeat
from engine.monitor.metrics import (
    MetricsWriter,
    SpikeDetector,
    Throughput,
    device_peak_tflops,
    model_flops_per_token,
)
from engine.monitor.moe_metrics import step_metrics
from engine.monitor.noise_scale import LocalGradSquares, NoiseScale
from engine.monitor.profiler import StepProfiler
from engine.monitor.stragglers import StragglerMonitor
from engine.monitor.wandb import WandbWriter
from engine.ops import agree_on_ops, select_ops
from engine.ops.fp8.apply import fp8_on_the_model
from engine.optim.lr_schedule import LRScheduler
from engine.optim.optimizer import build_optimizer
from engine.train import faults
from engine.train.batches import domain_names
from engine.train.checkpoint import resume
from engine.train.data_skips import pending_windows, recorded_in
from engine.train.datasets import build_datasets, split_sample_counts
from engine.train.exit_conditions import ExitConditions, earliest_start
from engine.train.loss import LossReduction
from engine.train.run_record import flat_settings, run_record
from engine.train.state import Progress, Run, logging_rank, params_dtype
from engine.train.step import StepFeatures
from engine.train.watchdog import build_watchdog
from parallel.data_parallel.ddp import DistributedDataParallel
from parallel.pipeline.schedules import get_schedule
from parallel.pipeline.tables import PLACEMENT
from parallel.random import model_parallel_seed
from parallel.state import ParallelState
from parallel.timing import StepTimes


def setup(cfg: Configs, state: ParallelState, started: float | None = None) -> Run:
    """The run of resolved configs `cfg` (engine/train/preflight.py's prepare) on this rank.
    `started`: when the process started (time.time()), from which --exit-duration-in-mins
    counts."""
    m, par, training = cfg.model, cfg.parallel, cfg.training
    expert_sizes = (par.expert_model_parallel_size, par.expert_tp_size if m.is_moe else 1)
    if m.is_moe and (state.ep_size, state.etp_size) != expert_sizes:
        raise ValueError(
            f"the parallel state has expert groups EP {state.ep_size} x ETP {state.etp_size} "
            f"where the flags ask for EP {expert_sizes[0]} x ETP {expert_sizes[1]}: build it "
            "with ParallelState.build(..., ep=, etp=) as engine/pretrain.py does"
        )
    started = earliest_start(
        time.time() if started is None else started, state.world_group, state.device
    )
    random.seed(training.seed)
    np.random.seed(training.seed % 2**32)
    if state.device.type == "cuda" and cfg.runtime.tf32:
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores for fp32 matmuls
    tracker = model_parallel_seed(
        training.seed, state.tp_rank, state.pp_rank, state.device, state.cp_rank
    )
    dtype = params_dtype(cfg.runtime)
    times = _step_times(cfg, state.device, state.rank)
    chunks = _model(cfg, state, tracker, dtype, times)
    optimizer = build_optimizer(
        chunks,
        cfg.optimizer,
        use_distributed_optimizer=par.shards_optimizer(),
        fp16=cfg.runtime.fp16,
        tp_rank=state.tp_rank,
        model_parallel_group=state.model_parallel_group,
        instance_group=state.optimizer_instance_group,
        device=state.device,
        dp_group=state.dp_cp_group,  # replicas agree on a non-finite gradient norm
        experts_apart=par.experts_apart,
        expert_norm_group=state.expert_tp_ep_pp_group,
        tp_group=state.tp_group,
        expert_tp_group=state.expert_tp_group,
    )
    optimizer.publish_weights()  # (--fp8-param-gather: the weights as FP8 from the start)
    batches = training.batch_schedule(state.dp_size, m.seq_length)
    scheduler = LRScheduler(
        cfg.optimizer, training.train_iters, batches.final, training.train_samples
    )
    seq = m.seq_length // state.cp_size  # the activations a pipeline stage sends on
    if par.sequence_parallel and state.tp_size > 1:
        seq //= state.tp_size

    def schedule_for(micro_batch: int):
        return get_schedule(
            state,
            virtual_size=par.virtual_size(m.num_layers),
            kind=par.pipeline_schedule,
            tensor_shape=(seq, micro_batch, m.hidden_size),
            dtype=dtype,
            overlap_p2p=par.overlap_p2p_communication,
            times=times,
            microbatch_group=par.microbatch_group_size_per_virtual_pipeline_stage,
        )

    schedule = schedule_for(training.micro_batch_size)
    _, eval_micro = cfg.evaluation.batch_sizes(batches.final, training.micro_batch_size)
    eval_schedule = (
        schedule if eval_micro == training.micro_batch_size else schedule_for(eval_micro)
    )
    sources = sources_of(cfg.data)
    mix = train_mix(sources.train, cfg.data.data_mix_schedule, training.train_iters, batches)
    scheduled = mix if cfg.data.data_mix_schedule else None
    recorded, needed = _recorded_train_split(cfg), split_sample_counts(cfg, batches.final)[0]
    datasets = build_datasets(cfg, sources, state, batches, scheduled, recorded)
    train_split = recorded if recorded is not None and recorded >= needed else needed
    # Checkpoints talk over their own gloo group: an async save runs its collectives in a
    # background thread, which must never interleave with the training's collectives.
    checkpoint_group = None
    if state.world_size > 1:
        checkpoint_group = dist.new_group(list(range(state.world_size)), backend="gloo")
    checkpointer = None
    if cfg.checkpointing.save:
        saving = cfg.checkpointing
        checkpointer = Checkpointer(
            saving.save,
            checkpoint_group,
            state.rank,
            saving.async_save,
            saving.keep_last_n,
            device=state.device,
            retain_interval=saving.save_retain_interval,
        )
    writes_meta = bool(cfg.checkpointing.save) and state.rank == 0  # meta.json: rank 0's
    run = Run(
        cfg=cfg,
        state=state,
        chunks=chunks,
        optimizer=optimizer,
        scheduler=scheduler,
        schedule=schedule,
        eval_schedule=eval_schedule,
        datasets=datasets,
        batches=batches,
        dtype=dtype,
        writer=_writer(cfg, state),
        checkpointer=checkpointer,
        checkpoint_group=checkpoint_group,
        throughput=_throughput(cfg, state),
        spikes=SpikeDetector(cfg.exit.spike_window, cfg.exit.spike_zscore),
        exit_conditions=ExitConditions(
            cfg.exit.exit_duration_in_mins,
            cfg.exit.exit_signal_handler,
            cfg.exit.exit_signal,
            started=started,
        ),
        profiler=StepProfiler(
            cfg.profiling,
            cfg.logging.tensorboard_dir,
            state.rank,
            state.device,
            optimizer.finish_param_sync,
        ),
        features=_features(cfg, state, chunks, times, domain_names(datasets[0])),
        progress=Progress(tracker=tracker),
        eval_prompts=_eval_prompts(cfg) if cfg.evaluation.eval_prompts else None,
        eval_tasks=eval_tasks_of(cfg) if cfg.evaluation.eval_tasks else None,
        mix=mix,
        packing=_packing(cfg),
        loss_reduction=LossReduction(training.calculate_per_token_loss, cfg.data.eod_mask_loss),
        tokenizer_identity=build_tokenizer(cfg.tokenizer).identity() if writes_meta else None,
        watchdog=build_watchdog(cfg, state, {"checkpoint": checkpoint_group}),
        stragglers=_stragglers(cfg, state),
        heartbeat=_heartbeat(cfg, state),
        record=run_record(cfg) if writes_meta else {},
        train_split_samples=train_split,
    )
    if recorded is not None and recorded < needed:
        run.writer.print(
            f"the train split grows from {recorded} to {needed} samples (a longer run, or more "
            "data windows to skip: --skip-data-iterations, --rollback-on-spike); its order "
            "stays the same unless that adds an epoch of the data"
        )
    if mix is not None and len(mix.phases) > 1:
        run.writer.print(mix.describe())
    if batches.describe():
        run.writer.print(batches.describe())
    if cfg.optimizer.optimizer == "muon":
        from engine.optim.muon_with_adam import describe_split

        run.writer.print(describe_split(chunks))
        sharded = optimizer.optimizer.sharded
        if sharded is not None:
            run.writer.print(sharded.describe())
    if cfg.checkpointing.load:
        resume(run)
    run.progress.pending_skips = _pending_skips(cfg, run.progress)
    if checkpointer is not None:
        checkpointer.prepare(chunks, optimizer, run.progress.tracker)
    return run


def _recorded_train_split(cfg: Configs) -> int | None:
    """The train split's size the resumed run recorded in its latest checkpoint (its order
    depends on it), or None (a fresh run, --finetune, an older checkpoint)."""
    load = cfg.checkpointing.load
    if not load or cfg.checkpointing.finetune:
        return None
    try:
        latest = find_latest(load)
    except UserError:
        return None  # (resume() names the problem)
    if latest is None:
        return None
    try:
        return read_meta(iteration_dir(load, latest)).get("train_split_samples")
    except (UserError, OSError):
        return None


def eval_tasks_of(cfg: Configs) -> EvalTasks:
    """--eval-tasks read and tokenized (preflight calls it too: a bad file is one line)."""
    tokenizer = plain_tokenizer(build_tokenizer(cfg.tokenizer))
    tasks = read_tasks(cfg.evaluation.eval_tasks, tokenizer, cfg.model.seq_length)
    return EvalTasks(tasks, tokenizer, tokenizer.eod)


def _pending_skips(cfg: Configs, progress: Progress) -> list:
    """The data windows to skip from the run's iteration on: --skip-data-iterations and the
    rollback windows recorded in --load and --save (engine/train/data_skips.py)."""
    folders = dict.fromkeys(f for f in (cfg.checkpointing.load, cfg.checkpointing.save) if f)
    recorded = [w for folder in folders for w in recorded_in(folder)]
    applied, iteration = progress.skipped_data, progress.counters.iteration
    return pending_windows(cfg.exit.data_skips(), recorded, applied, iteration)


def _heartbeat(cfg: Configs, state: ParallelState) -> Heartbeat | None:
    first_of_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
    folder = cfg.resilience.heartbeat_dir
    return Heartbeat(folder, state.rank) if folder and first_of_node else None


def _stragglers(cfg: Configs, state: ParallelState) -> StragglerMonitor | None:
    r = cfg.resilience
    if not r.log_straggler:
        return None
    return StragglerMonitor(state, r.straggler_threshold, r.straggler_minmax_count)


def _packing(cfg: Configs) -> Packing | None:
    """What the samples' end-of-document tokens change, with the tokenizer's EOD id (None
    when none of the three flags is given)."""
    data = cfg.data
    if not data.masks_documents:
        return None
    return Packing(
        build_tokenizer(cfg.tokenizer).eod,
        data.reset_position_ids,
        data.reset_attention_mask,
        data.eod_mask_loss,
    )


def _attention_kernels(chunks, documents: bool) -> str:
    """The start-up line naming each of this rank's layers' attention kernel."""
    from engine.model.attention import SelfAttention
    from engine.model.attention_kernel import describe

    found = [m for chunk in chunks for m in chunk.modules() if isinstance(m, SelfAttention)]
    found.sort(key=lambda m: m.layer_number)
    kinds = [m.kernel.document_kind if documents else m.kernel.kind for m in found]
    return describe(kinds, [m.layer_number for m in found])


def _model(cfg: Configs, state: ParallelState, tracker, dtype, times) -> list:
    """This rank's model chunks (one per virtual stage), each in its DDP wrapper."""
    m, par, runtime = cfg.model, cfg.parallel, cfg.runtime
    ops = agree_on_ops(
        select_ops(
            state.device, False if runtime.deterministic_mode else runtime.use_fused_kernels
        ),
        state.world_group,
        state.device,
    )
    if state.rank == 0:
        print(f"ops: {ops.name}", flush=True)
    chunks = build_model_chunks(
        m,
        state,
        params_dtype=dtype,
        seed=cfg.training.seed,
        sequence_parallel=par.sequence_parallel,
        gradient_accumulation_fusion=par.gradient_accumulation_fusion,
        tracker=tracker,
        virtual_size=par.virtual_size(m.num_layers),
        first_stage_layers=par.decoder_first_pipeline_num_layers,
        last_stage_layers=par.decoder_last_pipeline_num_layers,
        stage_counts=par.stage_counts(m.num_layers, m.mtp_depths),
        ops=ops,
        torch_compile=runtime.torch_compile,
        cp_comm_type=par.cp_comm_type,
        times=_tp_comm_times(times, cfg, state.device),
        placement=PLACEMENT.get(par.pipeline_schedule, "loop"),
    )
    if runtime.fp8 is not None:  # before the data-parallel wrappers see the modules
        fp8_on_the_model(chunks, runtime, m.num_layers, state.rank)
    if state.tp_rank == state.dp_rank == state.cp_rank == 0:  # one rank per pipeline stage
        stage = f" (pipeline rank {state.pp_rank})" if state.pp_size > 1 else ""
        kernels = _attention_kernels(chunks, cfg.data.reset_attention_mask)
        print(f"attention{stage}: {kernels}", flush=True)
    grad_dtype = torch.bfloat16 if runtime.bf16 and runtime.grad_reduce_in_bf16 else torch.float32
    # expert parallelism: the experts' buffers reduced over the expert data-parallel group
    experts = {"expert_dp_group": state.expert_dp_group} if par.experts_apart else {}
    return [
        DistributedDataParallel(
            c,
            # CP ranks hold the same weights: reduce and shard over both (the instance's part)
            state.dp_cp_shard_group,
            replica_group=state.dp_cp_replica_group,
            bucket_size=par.ddp_bucket_size,
            overlap_grad_reduce=par.overlap_grad_reduce,
            sharding=par.sharding_strategy(),
            overlap_param_gather=par.overlap_param_gather,
            grad_dtype=grad_dtype,
            **experts,
        )
        for c in chunks
    ]


def _features(cfg: Configs, state: ParallelState, chunks, times, names) -> StepFeatures:
    """The per-step measurements the logging flags ask for."""
    logging = cfg.logging
    local_squares = noise_scale = norm_parts = None
    if logging.log_gradient_noise_scale:
        local_squares, noise_scale = LocalGradSquares(chunks, state.tp_rank), NoiseScale()
    decoupled = cfg.optimizer.decoupled_lr is not None
    muon = cfg.optimizer.optimizer == "muon"
    if logging.log_grad_norms_interval:
        norm_parts = grad_norm_parts(cfg.model, chunks, decoupled, muon)
    cosine_parts = update_parts = activations = None
    if logging.log_gradient_cosine_interval:
        cosine_parts = grad_norm_parts(cfg.model, chunks, decoupled, muon)
    if logging.log_update_to_weight_ratios:
        update_parts = grad_norm_parts(cfg.model, chunks, decoupled, muon)
    if logging.log_activation_stats:
        activations = ActivationStats(chunks, cfg.model.num_layers, state.device)
    return StepFeatures(
        times=times,
        norm_parts=norm_parts,
        norm_parts_interval=logging.log_grad_norms_interval,
        local_squares=local_squares,
        noise_scale=noise_scale,
        domain_names=names,
        num_zeros=logging.log_num_zeros_in_grad,
        params_norm=logging.log_params_norm,
        moe_metrics=_moe_metrics(cfg, state),
        gradient_cosine_interval=logging.log_gradient_cosine_interval,
        cosine_parts=cosine_parts,
        pcgrad=cfg.optimizer.pcgrad,
        update_parts=update_parts,
        activation_stats=activations,
        health_interval=logging.log_interval,
    )


def _moe_metrics(cfg: Configs, state: ParallelState):
    """A mixture of experts' per-step measurements (engine/monitor/moe_metrics.py)."""
    if not cfg.model.is_moe:
        return None
    sequence_parallel = cfg.parallel.sequence_parallel and state.tp_size > 1
    return functools.partial(
        step_metrics, cfg=cfg.model, state=state, sequence_parallel=sequence_parallel
    )


def _writer(cfg: Configs, state: ParallelState) -> MetricsWriter:
    """The console, JSONL, TensorBoard and wandb writers (on the logging rank)."""
    logging, wandb = cfg.logging, None
    if logging.wandb_project and logging_rank(state):
        wandb = WandbWriter(logging, cfg.checkpointing, flat_settings(cfg, state))
    return MetricsWriter(
        logging_rank(state),
        logging.log_jsonl,
        logging.tensorboard_dir,
        wandb,
        tensorboard_queue_size=logging.tensorboard_queue_size,
    )


def _throughput(cfg: Configs, state: ParallelState) -> Throughput:
    """Tokens/s, TFLOP/s per device and MFU against the device's peak at the run's precision."""
    m, runtime = cfg.model, cfg.runtime
    flops = model_flops_per_token(m, m.padded_vocab_size(state.tp_size))
    precision = "bf16" if runtime.bf16 else "fp16" if runtime.fp16 else "fp32"
    peak, _ = device_peak_tflops(state.device, precision)
    return Throughput(flops, state.world_size, peak)


def _step_times(cfg: Configs, device, rank: int) -> StepTimes:
    sync = None
    # GPU work counted where it runs, at a cost; --log-straggler needs each rank's own compute
    # apart from its waits, which host times without a sync do not give
    wanted = cfg.logging.timing_log_level >= 1 or cfg.resilience.log_straggler
    if wanted and device.type == "cuda":
        sync = torch.cuda.synchronize
    return faults.step_times(sync, rank)


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


def _eval_prompts(cfg: Configs) -> EvalPrompts:
    """--eval-prompts read and tokenized (every rank: they decode together)."""
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
