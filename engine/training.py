"""The training run: set-up from the configs, the loop, evaluation, logging, checkpoints.

Each iteration: the pipeline schedule runs the global batch's micro-batches, gradients are
reduced (finalize_model_grads), the loss is made known to every rank, and the optimizer steps
unless the loss or the gradient is NaN/Inf (the step is skipped and counted; with
--exit-on-nan-count the run stops after that many) or, with --skip-spike-batches, the loss is
a spike (z-score over a window of recent losses). A skipped step does not advance the
learning-rate schedule; the "lr" logged is the one the iteration's update used or would have.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from engine import faults
from engine.checkpoint_files import find_latest, iteration_dir
from engine.checkpoint_load import load_checkpoint
from engine.checkpointing import Checkpointer
from engine.compat.megatron_flags import MegatronCompatConfig
from engine.config import DataConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
from engine.data.builder import (
    build_gpt_datasets,
    build_mock_datasets,
    build_streaming_datasets,
    data_format,
)
from engine.data.gpt_dataset import SPLIT_NAMES
from engine.data.loader import build_data_iterator
from engine.data.streaming import StreamingDataset
from engine.data.tokenizers import TokenizerConfig, build_tokenizer, tokenizer_record
from engine.errors import ConfigError
from engine.metrics import (
    MetricsWriter,
    SpikeDetector,
    Throughput,
    device_peak_tflops,
    memory_gb,
    model_flops_per_token,
)
from engine.model.builder import build_model_chunks
from engine.ops import select_ops
from engine.optim import LRScheduler, build_optimizer
from engine.profiling import StepProfiler
from engine.run_control import ExitConditions, earliest_start
from engine.step import eval_step, train_step
from parallel.ddp import DistributedDataParallel
from parallel.pipeline.schedules import get_schedule
from parallel.random import model_parallel_seed
from parallel.state import ParallelState


@dataclass
class Configs:
    model: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    data: DataConfig
    train: TrainConfig
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    megatron: MegatronCompatConfig = field(default_factory=MegatronCompatConfig)
    given: frozenset[str] = frozenset()  # the flags on the command line


@dataclass
class Counters:
    """Run state that is not in the model or optimizer, saved in meta.json."""

    iteration: int = 0
    consumed_samples: int = 0
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
    num_microbatches: int
    global_batch: int
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


def params_dtype(train: TrainConfig) -> torch.dtype:
    return torch.bfloat16 if train.bf16 else torch.float16 if train.fp16 else torch.float32


def layout_of(state: ParallelState, cfg: Configs) -> dict:
    return {
        "tp": state.tp_size,
        "pp": state.pp_size,
        "dp": state.dp_size,
        "virtual": cfg.parallel.virtual_size(cfg.model.num_layers),
        "distributed_optimizer": cfg.parallel.use_distributed_optimizer,
    }


def _logging_rank(state: ParallelState) -> bool:
    return state.is_last_stage and state.tp_rank == 0 and state.dp_rank == 0


def setup(cfg: Configs, state: ParallelState, started: float | None = None) -> Run:
    """Model, optimizer, data, and (with --load) the state of a checkpoint. `started`: when
    the process started (time.time()), from which --exit-duration-in-mins counts."""
    m, par, train = cfg.model, cfg.parallel, cfg.train
    started = earliest_start(
        time.time() if started is None else started, state.world_group, state.device
    )
    train.resolve_length(state.dp_size)
    random.seed(train.seed)
    np.random.seed(train.seed % 2**32)
    tracker = model_parallel_seed(train.seed, state.tp_rank, state.pp_rank, state.device)
    dtype = params_dtype(train)
    virtual = par.virtual_size(m.num_layers)
    ops = select_ops(state.device, train.use_fused_kernels)
    if state.rank == 0:
        print(f"ops: {ops.name}", flush=True)
    chunks = build_model_chunks(
        m,
        state,
        params_dtype=dtype,
        seed=train.seed,
        sequence_parallel=par.sequence_parallel,
        tracker=tracker,
        virtual_size=virtual,
        first_stage_layers=par.decoder_first_pipeline_num_layers,
        last_stage_layers=par.decoder_last_pipeline_num_layers,
        ops=ops,
    )
    ddps = [
        DistributedDataParallel(
            c,
            state.dp_group,
            bucket_size=par.ddp_bucket_size,
            overlap_grad_reduce=par.overlap_grad_reduce,
            use_distributed_optimizer=par.use_distributed_optimizer,
            overlap_param_gather=par.overlap_param_gather,
        )
        for c in chunks
    ]
    optimizer = build_optimizer(
        ddps,
        cfg.optimizer,
        use_distributed_optimizer=par.use_distributed_optimizer,
        fp16=train.fp16,
        tp_rank=state.tp_rank,
        model_parallel_group=state.model_parallel_group,
        world_group=state.world_group,
        device=state.device,
    )
    num_microbatches = train.num_microbatches(state.dp_size)
    global_batch = train.global_batch(state.dp_size)
    scheduler = LRScheduler(cfg.optimizer, train.train_iters, global_batch, train.train_samples)
    seq = (
        m.seq_length // state.tp_size
        if par.sequence_parallel and state.tp_size > 1
        else m.seq_length
    )
    schedule = get_schedule(
        state,
        virtual_size=virtual,
        kind=par.pipeline_schedule,
        tensor_shape=(seq, train.micro_batch_size, m.hidden_size),
        dtype=dtype,
        overlap_p2p=par.overlap_p2p_communication,
    )
    datasets = _datasets(cfg, state, global_batch)
    flops = model_flops_per_token(m, m.padded_vocab_size(state.tp_size))
    peak, _ = device_peak_tflops(
        state.device, "bf16" if train.bf16 else "fp16" if train.fp16 else "fp32"
    )
    writer = MetricsWriter(_logging_rank(state), train.log_jsonl, train.tensorboard_dir)
    # Checkpoints talk over their own gloo group: an async save runs its collectives in a
    # background thread, which must never interleave with the training's collectives.
    checkpoint_group = None
    if state.world_size > 1:
        checkpoint_group = dist.new_group(list(range(state.world_size)), backend="gloo")
    checkpointer = None
    if train.save:
        checkpointer = Checkpointer(
            train.save, checkpoint_group, state.rank, train.async_save, train.keep_last_n
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
        num_microbatches,
        global_batch,
        dtype,
        writer,
        checkpointer,
        checkpoint_group,
        Throughput(flops, state.world_size, peak),
        SpikeDetector(train.spike_window, train.spike_zscore),
        exit_conditions=ExitConditions(
            train.exit_duration_in_mins, train.exit_signal_handler, started=started
        ),
        profiler=StepProfiler(train, state.rank, state.device),
    )
    if train.load:
        _resume(run)
    if checkpointer is not None:
        checkpointer.prepare(ddps, optimizer, run.tracker)
    return run


def split_sample_counts(train, global_batch: int) -> tuple[int, int, int]:
    """Samples asked of the train, valid and test splits, as Megatron-LM asks them (the sizes
    decide how many epochs each split spans, and so its order): the whole run; --eval-iters
    batches for each evaluation of the run and one more; --eval-iters batches."""
    evaluations = train.train_iters // train.eval_interval + 1 if train.eval_interval else 1
    return (
        train.train_samples or train.train_iters * global_batch,
        evaluations * train.eval_iters * global_batch,
        train.eval_iters * global_batch,
    )


def _datasets(cfg: Configs, state: ParallelState, global_batch: int) -> list:
    train = cfg.train
    samples = split_sample_counts(train, global_batch)
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
                train.seed,
                samples,
                cfg.tokenizer,
            )
        if data.mock_data:
            return build_mock_datasets(
                tokenizer.vocab_size,
                tokenizer.eod,
                cfg.model.seq_length,
                train.seed,
                samples,
                data.data_cache_path,
            )
        return build_gpt_datasets(
            data.data_path,
            data.split,
            cfg.model.seq_length,
            train.seed,
            samples,
            data.data_cache_path,
            data.per_split_paths,
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
    evaluation = train.eval_iters * global_batch  # each evaluation reads the same first ones
    for name, dataset, needed in zip(SPLIT_NAMES, datasets, (samples[0], evaluation, evaluation)):
        if dataset is not None and len(dataset) < needed:
            raise ConfigError(
                f"the {name} split has {len(dataset)} samples and the run needs {needed}: "
                "prefixes given alone (--data-path A B) blend one epoch of each; give weights "
                "(0.5 A 0.5 B) to repeat them, or train for less"
            )
    return datasets


def _resume(run: Run) -> None:
    train = run.cfg.train
    iteration = find_latest(train.load)
    if iteration is None:
        run.writer.print(f"no checkpoint in {train.load}; starting from scratch")
        return
    path = iteration_dir(train.load, iteration)
    # As Megatron-LM: --finetune takes the weights alone; --no-load-optim leaves out the
    # optimizer, its loss scaler and the learning-rate schedule; --no-load-rng the RNG.
    load_optimizer = not (train.finetune or train.no_load_optim)
    meta = load_checkpoint(
        path,
        run.chunks,
        run.optimizer,
        run.state.rank,
        layout_of(run.state, run.cfg),
        run.tracker,
        group=run.checkpoint_group,
        load_optimizer=load_optimizer,
        verify=train.verify_checkpoint,
        load_rng=not (train.finetune or train.no_load_rng),
    )
    if train.finetune:
        run.writer.print(f"fine-tuning from the weights of {path}; starting at iteration 0")
        _reseed(run, 0)
        return
    counters = meta.get("counters", {})
    run.counters = Counters(
        iteration=meta["iteration"],
        consumed_samples=meta["consumed_samples"],
        skipped_iters=counters.get("skipped_iters", 0),
        nan_iters=counters.get("nan_iters", 0),
        optimizer_step=meta.get("optimizer_step", 0) if load_optimizer else 0,
    )
    if load_optimizer:
        run.scheduler.load_state_dict(meta["scheduler"])
        if run.optimizer.grad_scaler is not None and meta.get("grad_scaler"):
            run.optimizer.grad_scaler.load_state_dict(meta["grad_scaler"])
    run.spikes.load_state_dict(meta.get("spikes", {}))
    run.data_state = meta.get("data")
    if not meta["rng_restored"]:
        how = "with re-seeded random streams (" + (
            "--no-load-rng)" if train.no_load_rng else "new layout)"
        )
    else:
        how = "exactly"
    if not load_optimizer:
        how += "; optimizer and learning-rate schedule start afresh (--no-load-optim)"
    checked = (
        "files verified"
        if meta["verified"]
        else "checksums not compared (--no-verify)"
        if "files" in meta
        else "no checksums recorded in this older checkpoint"
    )
    run.writer.print(f"resumed from {path} at iteration {meta['iteration']} ({how}; {checked})")
    if not meta["rng_restored"]:
        _reseed(run, meta["iteration"])


def _reseed(run: Run, iteration: int) -> None:
    seed = run.cfg.train.seed + iteration
    run.tracker = model_parallel_seed(seed, run.state.tp_rank, run.state.pp_rank, run.state.device)
    for chunk in run.chunks:
        for module in chunk.module.modules():
            if hasattr(module, "ctx"):
                module.ctx.tracker = run.tracker


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def train_iteration(run: Run, batches: list[dict]) -> dict:
    """One optimizer step, or a skipped one (NaN/Inf loss or gradient, or a loss spike with
    --skip-spike-batches). Collective on every rank; every rank decides the same."""
    rank, iteration = run.state.rank, run.counters.iteration + 1
    faults.before_iteration(rank, iteration, batches, run.cfg.model.vocab_size)
    decision = {"spike_z": None, "attempted": False}

    def should_step(loss: float) -> bool:
        if not math.isfinite(loss):
            return False
        decision["spike_z"] = run.spikes.check(loss)
        decision["attempted"] = decision["spike_z"] is None or not run.cfg.train.skip_spike_batches
        return decision["attempted"]

    out = train_step(
        run.chunks,
        run.optimizer,
        run.scheduler,
        batches,
        run.state,
        run.schedule,
        after_backward=lambda: faults.after_backward(rank, iteration, run.chunks),
        should_step=should_step,
        before_update=run.checkpointer.wait_for_copy if run.checkpointer else None,
    )
    # An attempted step that did not update had a non-finite gradient (with fp16 that is a
    # loss-scale overflow, which the scaler handles and is not counted).
    bad_gradient = decision["attempted"] and not out.updated and run.optimizer.grad_scaler is None
    return {
        "lm_loss": out.loss,
        "lr": out.lr,
        "spike_z": decision["spike_z"],
        "updated": out.updated,
        "grad_norm": out.grad_norm,
        "loss_scale": out.loss_scale,
        "nan": not math.isfinite(out.loss) or bad_gradient,
    }


def evaluate(run: Run, split: int) -> float | None:
    """Mean loss over --eval-iters global batches of a split (the same ones every time)."""
    dataset = run.datasets[split]
    if dataset is None or run.cfg.train.eval_iters == 0:
        return None
    run.optimizer.finish_param_sync()
    state, train = run.state, run.cfg.train
    iterator = _data_iterator(run, dataset, 0, num_workers=0)
    total = 0.0
    for _ in range(train.eval_iters):
        batches = [_to_device(next(iterator), state.device) for _ in range(run.num_microbatches)]
        total += eval_step(run.chunks, batches, state, run.schedule)
    return total / train.eval_iters


def save(run: Run) -> None:
    c = run.counters
    meta = {
        "consumed_samples": c.consumed_samples,
        "layout": layout_of(run.state, run.cfg),
        "model": dataclasses.asdict(run.cfg.model),
        "dtype": str(run.dtype).replace("torch.", ""),
        "tokenizer": tokenizer_record(run.cfg.tokenizer),
        "scheduler": run.scheduler.state_dict(),
        "grad_scaler": run.optimizer.grad_scaler.state_dict()
        if run.optimizer.grad_scaler
        else None,
        "optimizer_step": c.optimizer_step,
        "counters": {"skipped_iters": c.skipped_iters, "nan_iters": c.nan_iters},
        "spikes": run.spikes.state_dict(),
    }
    if isinstance(run.datasets[0], StreamingDataset):
        meta["data"] = run.train_iterator.state_dict()
    stall = run.checkpointer.save(c.iteration, run.chunks, run.optimizer, meta, run.tracker)
    run.last_saved = c.iteration
    kind = "started (async)" if run.cfg.train.async_save else "saved"
    run.writer.print(
        f"checkpoint {kind}: {iteration_dir(run.checkpointer.root, c.iteration)} "
        f"(stalled {stall:.2f}s)"
    )


def _log(run: Run, window: list[dict], tokens: int) -> None:
    c, train = run.counters, run.cfg.train
    updated = [r for r in window if r["updated"]]
    losses = [r["lm_loss"] for r in updated] or [r["lm_loss"] for r in window]
    loss = sum(losses) / len(losses)
    last = window[-1]
    record = {
        "iteration": c.iteration,
        "consumed_samples": c.consumed_samples,
        "lm_loss": loss if math.isfinite(loss) else None,
        "lr": last["lr"],
        "grad_norm": last["grad_norm"],
        "loss_scale": last.get("loss_scale"),
        "batch_size": run.global_batch,
        "skipped_iters": c.skipped_iters,
        **run.throughput.rates(tokens),
        "mem_gb": memory_gb(run.state.device),
    }
    run.throughput.reset()
    run.writer.log(record, c.iteration)
    mfu = f" | mfu {record['mfu']:.1%}" if "mfu" in record else ""
    grad = f"{record['grad_norm']:.3f}" if record["grad_norm"] is not None else "skipped"
    run.writer.print(
        f"iteration {c.iteration:6d}/{train.train_iters} | consumed {c.consumed_samples} | "
        f"lm loss {loss:.4f} | lr {record['lr']:.3e} | grad norm {grad} | "
        f"{record['tokens_per_sec']:,.0f} tokens/s | {record['tflops_per_device']:.3f} "
        f"TFLOP/s/device{mfu} | skipped {c.skipped_iters} | mem {record['mem_gb']:.2f} GB"
    )


def _log_eval(run: Run, name: str, loss: float | None) -> None:
    if loss is None:
        return
    ppl = math.exp(min(loss, 50.0))
    c = run.counters
    record = {"iteration": c.iteration, "consumed_samples": c.consumed_samples}
    run.writer.log(record | {"split": name, "lm_loss": loss, "ppl": ppl}, c.iteration, name)
    run.writer.print(
        f"{name} at iteration {run.counters.iteration}: lm loss {loss:.4f} | perplexity {ppl:.2f}"
    )


def _data_iterator(run: Run, dataset, consumed: int, num_workers: int, state=None):
    """This DP rank's micro-batches of a split from `consumed` samples on."""
    mbs, dp_rank, dp_size = run.cfg.train.micro_batch_size, run.state.dp_rank, run.state.dp_size
    if isinstance(dataset, StreamingDataset):
        return dataset.iterator(consumed, mbs, dp_rank, dp_size, num_workers, state)
    return build_data_iterator(dataset, consumed, mbs, dp_rank, dp_size, num_workers)


class NaNLimit(Exception):
    """--exit-on-nan-count reached."""


def train(run: Run) -> Counters:
    """The loop from the current counters to --train-iters (or --exit-interval)."""
    state, train_cfg, c = run.state, run.cfg.train, run.counters
    iterator = _data_iterator(
        run, run.datasets[0], c.consumed_samples, run.cfg.data.num_workers, run.data_state
    )
    run.train_iterator = iterator
    window: list[dict] = []
    tokens_since_log = 0
    run.throughput.reset()
    while c.iteration < train_cfg.train_iters:
        run.profiler.before_iteration(c.iteration)
        batches = [_to_device(next(iterator), state.device) for _ in range(run.num_microbatches)]
        record = train_iteration(run, batches)
        c.iteration += 1
        run.profiler.after_iteration(c.iteration)
        c.consumed_samples += run.global_batch
        tokens_since_log += run.global_batch * run.cfg.model.seq_length
        c.skipped_iters += not record["updated"]
        c.optimizer_step += record["updated"]
        c.nan_iters += record["nan"]
        if record["spike_z"] is not None:
            action = "update skipped" if train_cfg.skip_spike_batches else "kept"
            run.writer.print(
                f"loss spike at iteration {c.iteration}: {record['lm_loss']:.4f} "
                f"(z = {record['spike_z']:.1f}); {action}"
            )
        window.append(record)
        if c.iteration % train_cfg.log_interval == 0 or c.iteration == train_cfg.train_iters:
            _log(run, window, tokens_since_log)
            window, tokens_since_log = [], 0
        every = train_cfg.eval_interval
        if every and c.iteration % every == 0 and c.iteration < train_cfg.train_iters:
            _log_eval(run, "valid", evaluate(run, 1))
        if train_cfg.exit_on_nan_count and c.nan_iters >= train_cfg.exit_on_nan_count:
            raise NaNLimit(
                f"stopping at iteration {c.iteration}: {c.nan_iters} iterations with a NaN/Inf "
                f"loss or gradient (--exit-on-nan-count {train_cfg.exit_on_nan_count}); "
                "checkpoints already saved are kept"
            )
        stop = bool(train_cfg.exit_interval) and c.iteration % train_cfg.exit_interval == 0
        if run.checkpointer is not None and (
            stop or (train_cfg.save_interval and c.iteration % train_cfg.save_interval == 0)
        ):
            save(run)
        if stop:
            run.writer.print(f"exiting at iteration {c.iteration} (--exit-interval)")
            break
        reason = run.exit_conditions.check(run.state.world_group, run.state.device)
        if reason:
            if run.checkpointer is not None and run.last_saved != c.iteration:
                save(run)
            run.writer.print(f"exiting at iteration {c.iteration}: {reason}")
            break
    return c


def finish(run: Run) -> None:
    """End of run: valid and test evaluation, a final checkpoint, peak memory per rank."""
    c, train_cfg = run.counters, run.cfg.train
    if c.iteration >= train_cfg.train_iters:
        _log_eval(run, "valid", evaluate(run, 1))
        _log_eval(run, "test", evaluate(run, 2))
        if run.checkpointer is not None and run.last_saved != c.iteration:
            save(run)
    if run.checkpointer is not None:
        run.checkpointer.wait()
    run.exit_conditions.close()
    run.profiler.close()
    peaks = torch.zeros(run.state.world_size, dtype=torch.float64, device=run.state.device)
    peaks[run.state.rank] = memory_gb(run.state.device)
    if run.state.world_group is not None:
        dist.all_reduce(peaks, group=run.state.world_group)
    peaks = peaks.tolist()
    if run.state.rank == 0:
        print("peak memory per rank (GB): " + ", ".join(f"{p:.2f}" for p in peaks), flush=True)
    run.writer.close()
