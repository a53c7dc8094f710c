"""The one writer of a run's configuration after parsing.

`resolve(cfg, world_size, ...)` returns the configs with everything derived filled in: the
data paths read from --data-args-path / --per-split-data-args-path, the model's shape and the
tokenizer taken from a checkpoint (--use-checkpoint-args), --sequence-parallel dropped where
there is no tensor parallelism to split over (as in Megatron-LM), --train-iters from
--train-samples, and the vocabulary size from the tokenizer. Every config is frozen; nothing
else builds a changed one, and every check afterwards only reads (the checks' homes are named
in docs/architecture.md).

What it needs from outside the configs comes in as values or a function, so this folder
imports nothing above it: what a checkpoint records (`SavedArchitecture`, read by
engine/train/preflight.py) and how large a tokenizer's vocabulary is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from engine.config.configs import Configs
from engine.config.model import ModelConfig
from engine.config.tokenizer import TokenizerConfig
from engine.config.training import TrainingConfig
from engine.errors import ConfigError
from parallel.state import check_layout


@dataclass(frozen=True)
class SavedArchitecture:
    """What --use-checkpoint-args takes from a checkpoint: the fields of its model config that
    define the tensors, and the tokenizer it records (None: the flags' tokenizer stays)."""

    model: ModelConfig
    fields: tuple[str, ...]
    tokenizer: TokenizerConfig | None = None


def resolve(
    cfg: Configs,
    world_size: int,
    saved: SavedArchitecture | None = None,
    vocab_size_of: Callable[[TokenizerConfig], int] | None = None,
) -> Configs:
    """The configs with everything derived filled in (module docstring). `saved`: the
    checkpoint's architecture with --use-checkpoint-args; `vocab_size_of`: a tokenizer
    config's vocabulary size (without it the vocabulary is left as the flags give it, as the
    layout planner does). ConfigError (one line) when a derived value cannot be had: a layout
    the world size does not divide, a model shape or batch that cannot be, a missing or
    contradictory length."""
    model, tokenizer = cfg.model, cfg.tokenizer
    if saved is not None:
        taken = with_saved_architecture(cfg, saved)
        model, tokenizer = taken.model, taken.tokenizer
    parallel, optimizer = cfg.parallel, cfg.optimizer
    if optimizer.optimizer == "dist_muon":  # Megatron-LM's spelling of Muon, sharded
        optimizer = dataclasses.replace(optimizer, optimizer="muon")
        if not parallel.shards_optimizer():
            parallel = dataclasses.replace(parallel, use_distributed_optimizer=True)
    tp = parallel.tensor_model_parallel_size
    if parallel.sequence_parallel and tp == 1:
        parallel = dataclasses.replace(parallel, sequence_parallel=False)  # nothing to split
    dp = check_layout(
        world_size, tp, parallel.pipeline_model_parallel_size, cp=parallel.context_parallel_size
    )
    # the fields the length is derived from are checked first (as the layout checks did)
    model.validate(tp, parallel.sequence_parallel)
    cfg.training.validate()
    training = with_length(cfg.training, dp, model.seq_length)
    if vocab_size_of is not None:
        tokenizer = tokenizer.with_vocab_size(cfg.model.vocab_size)  # --vocab-size as given
        if model.vocab_size is None or tokenizer.vocab_size is not None:
            # NullTokenizer / TikTokenizer: theirs is the flag's
            model = dataclasses.replace(model, vocab_size=vocab_size_of(tokenizer))
    return dataclasses.replace(
        cfg,
        model=model,
        parallel=parallel,
        optimizer=optimizer,
        training=training,
        tokenizer=tokenizer,
        data=cfg.data.with_path_files(),
    )


def with_saved_architecture(cfg: Configs, saved: SavedArchitecture) -> Configs:
    """The configs with the model's shape from a checkpoint (--use-checkpoint-args): its
    fields, and its sequence length unless --seq-length is given (as Megatron-LM); and its
    tokenizer when no tokenizer flag is given."""
    taken = {name: getattr(saved.model, name) for name in saved.fields}
    if "--seq-length" not in cfg.given:
        taken["seq_length"] = saved.model.seq_length
    tokenizer = cfg.tokenizer
    if tokenizer == TokenizerConfig() and saved.tokenizer is not None:
        tokenizer = saved.tokenizer
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, **taken), tokenizer=tokenizer
    )


def with_length(training: TrainingConfig, dp: int, seq_length: int) -> TrainingConfig:
    """The training config with --train-iters set from --train-samples (the steps that fit, as
    Megatron-LM counts them); ConfigError if the length is missing or contradictory."""
    schedule = training.batch_schedule(dp, seq_length)
    if training.train_samples is None:
        if training.train_iters is None:
            raise ConfigError(
                "the length of training is missing: give --train-iters N or --train-samples N"
            )
        if training.rampup_batch_size is not None:
            raise ConfigError(
                "--rampup-batch-size needs a run counted in samples (as in Megatron-LM): "
                "give --train-samples instead of --train-iters"
            )
        return training
    iters = schedule.iterations_for_samples(training.train_samples)
    if training.train_iters is not None and training.train_iters != iters:
        raise ConfigError(
            "--train-iters and --train-samples both give the length of training; give one"
        )
    if iters < 1:
        raise ConfigError(
            f"--train-samples {training.train_samples} is less than one global batch "
            f"({schedule.at(0)})"
        )
    return dataclasses.replace(training, train_iters=iters)
