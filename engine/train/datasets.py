"""The run's train, valid and test datasets, each with the samples the run asks of it (as
Megatron-LM asks them, which decides how many epochs a split spans and so its order)."""

from __future__ import annotations

import torch.distributed as dist

from engine.config.batch_schedule import BatchSchedule
from engine.config.configs import Configs
from engine.data.builder import build_gpt_datasets, build_mock_datasets, build_streaming_datasets
from engine.data.fim import FimSamples, FimTransform
from engine.data.indexed.gpt_dataset import SPLIT_NAMES
from engine.data.indexed.split import IndexedSplit
from engine.data.sources import DataSources
from engine.data.split import TrainingSplit
from engine.data.tokenizers import build_tokenizer
from engine.errors import ConfigError
from parallel.state import ParallelState


def split_sample_counts(cfg: Configs, global_batch: int) -> tuple[int, int, int]:
    """Samples asked of the train, valid and test splits, as Megatron-LM asks them (the sizes
    decide how many epochs each split spans, and so its order): the whole run; --eval-iters
    batches (of --eval-global-batch-size, default the training's) for each evaluation of the
    run and one more; --eval-iters batches. The train split also holds the data windows the
    run may skip (skip_reserve)."""
    training, evaluation = cfg.training, cfg.evaluation
    every = evaluation.eval_interval
    evaluations = training.train_iters // every + 1 if every else 1
    eval_batch, _ = evaluation.batch_sizes(global_batch, training.micro_batch_size)
    return (
        (training.train_samples or training.train_iters * global_batch)
        + skip_reserve(cfg, global_batch),
        evaluations * evaluation.eval_iters * eval_batch,
        evaluation.eval_iters * eval_batch,
    )


def skip_reserve(cfg: Configs, global_batch: int) -> int:
    """Training samples beyond the run's for the windows it may skip: --skip-data-iterations'
    and, with --rollback-on-spike, --rollback-max windows of up to --rollback-iterations plus
    one --save-interval each. (More samples can mean another epoch, and so another order,
    than a run without these flags.)"""
    exits = cfg.exit
    iterations = sum(last - first + 1 for first, last in exits.data_skips())
    if exits.rollback_on_spike:
        longest = exits.rollback_iterations + (cfg.checkpointing.save_interval or 0)
        iterations += exits.rollback_max * longest
    return iterations * global_batch


def build_datasets(
    cfg: Configs,
    sources: DataSources,
    state: ParallelState,
    batches: BatchSchedule,
    mix,
    train_samples: int | None = None,
) -> list[TrainingSplit | None]:
    """[train, valid, test] of `sources` for the run (None where a split has no samples), each
    with the samples the run asks of it (the train split: `train_samples` where the run
    resumes one that recorded its split's size and that size is enough, so that its order
    stays the same); with
    --data-mix-schedule, `mix` orders the train split. ConfigError (one line) when the train
    split is empty or a split is too small."""
    global_batch = batches.final
    samples = split_sample_counts(cfg, global_batch)
    if train_samples is not None and train_samples >= samples[0]:
        samples = (train_samples, *samples[1:])
    data, seq, seed = cfg.data, cfg.model.seq_length, cfg.training.seed

    def build() -> list[TrainingSplit | None]:
        if sources.format == "parquet":  # a stream is a training split itself
            return build_streaming_datasets(
                sources,
                data.parquet_text_column,
                data.parquet_shuffle_buffer,
                seq,
                seed,
                samples,
                cfg.tokenizer,
            )
        if sources.format == "mock":
            tokenizer = build_tokenizer(cfg.tokenizer)
            blended = build_mock_datasets(
                tokenizer.vocab_size, tokenizer.eod, seq, seed, samples, data.data_cache_path
            )
        else:
            blended = build_gpt_datasets(sources, seq, seed, samples, data.data_cache_path, mix)
        if cfg.fim.fim_data:  # (preprocessed data only: engine/train/preflight.py)
            transform = FimTransform(cfg.fim, build_tokenizer(cfg.tokenizer), seed)
            blended = [FimSamples(d, transform) if d is not None else None for d in blended]
        return [IndexedSplit(d) if d is not None else None for d in blended]

    # Rank 0 builds the index caches (indexed and mock data); the others then load them.
    if state.rank == 0:
        datasets = build()
    if state.world_group is not None:
        dist.barrier(group=state.world_group)
    if state.rank != 0:
        datasets = build()
    if datasets[0] is None:
        raise ConfigError(f"--split {data.split} leaves no training documents")
    # a ramp's last step may pass --train-samples
    _, consumed = batches.sizes(cfg.training.train_iters)
    needs = (max(samples[0], consumed), samples[1], samples[2])
    for name, dataset, needed in zip(SPLIT_NAMES, datasets, needs, strict=False):
        if dataset is not None and len(dataset) < needed:
            raise ConfigError(
                f"the {name} split has {len(dataset)} samples and the run needs {needed}: "
                "prefixes given alone (--data-path A B) blend one epoch of each; give weights "
                "(0.5 A 0.5 B) to repeat them, or train for less"
            )
    return datasets
