"""Every check of a pretraining configuration that needs no process group.

`check(cfg, world_size)` runs in each rank before the process group starts, and in the
launcher (engine/launch.py) once before any rank starts, so that a wrong flag, layout, path,
split, tokenizer or checkpoint is one line and exit code 2 instead of a traceback per rank:
flags and their combinations, the layout against the world size, the batch split, the data
(files, the train split, token ids against the vocabulary), the tokenizer, the places the run
writes to, and the checkpoint to resume from (complete, every file its recorded size).
"""

from __future__ import annotations

import os

import torch

from engine.checkpoint.files import find_latest, iteration_dir, read_meta
from engine.checkpoint.load import verify_checkpoint
from engine.config.megatron_flags import check_compat
from engine.config.model import ModelConfig
from engine.data.builder import data_format, split_blends
from engine.data.indexed.dataset import IndexedDataset
from engine.data.indexed.gpt_dataset import SPLIT_NAMES, sequence_range
from engine.data.prepare.token_ids import check_token_ids
from engine.data.streaming.shards import open_shards
from engine.data.tokenizers import TokenizerConfig, build_tokenizer, config_from_record
from engine.errors import ConfigError, UserError
from engine.files.outputs import probe_writable_folder
from engine.interop.megatron.checkpoint import megatron_latest, megatron_progress
from engine.interop.megatron.layout import model_config_from_args
from engine.monitor.profiler import check_profile_flags
from engine.monitor.wandb import check_wandb_flags, wandb_folder
from parallel.errors import describe_os_error
from parallel.pipeline.layout import stage_layers
from parallel.pipeline.tables import PLACEMENT, SPLIT_BACKWARD, V_SHAPED, min_microbatches
from parallel.state import check_layout

# Fields that define the model's tensors; --use-checkpoint-args takes them from the checkpoint.
ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "ffn_hidden_size",
    "kv_channels",
    "max_position_embeddings",
    "vocab_size",
    "position_embedding_type",
    "rotary_base",
    "normalization",
    "norm_epsilon",
    "apply_layernorm_1p",
    "swiglu",
    "openai_gelu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "qk_layernorm",
)


def _use_megatron_args(cfg, path: str) -> None:
    """--use-checkpoint-args with a Megatron-LM checkpoint: the shape from its saved arguments
    (its padded vocabulary is the vocabulary, as its softmax covers every padded row)."""
    args = megatron_progress(path)["args"]
    if args is None:
        raise ConfigError(
            f"--use-checkpoint-args: {path}/common.pt holds no saved arguments; give the model's "
            "flags instead"
        )
    saved = model_config_from_args(args)
    for name in (*ARCHITECTURE_FIELDS, "make_vocab_size_divisible_by", "rotary_percent"):
        setattr(cfg.model, name, getattr(saved, name))
    if "--seq-length" not in cfg.given:
        cfg.model.seq_length = saved.seq_length


def use_checkpoint_args(cfg) -> None:
    megatron = megatron_latest(cfg.train.load)
    if megatron is not None:
        _use_megatron_args(cfg, megatron)
        return
    iteration = find_latest(cfg.train.load)
    if iteration is None:
        raise ConfigError(f"--use-checkpoint-args: no checkpoint in {cfg.train.load}")
    meta = read_meta(iteration_dir(cfg.train.load, iteration))
    saved = ModelConfig.from_record(meta["model"])
    for name in ARCHITECTURE_FIELDS:
        setattr(cfg.model, name, getattr(saved, name))
    if "--seq-length" not in cfg.given:  # as Megatron-LM: the checkpoint's unless given
        cfg.model.seq_length = saved.seq_length
    saved_tokenizer = config_from_record(meta)
    if cfg.tokenizer == TokenizerConfig() and saved_tokenizer is not None:
        cfg.tokenizer = saved_tokenizer  # no tokenizer flags given: continue with the saved one
        try:
            build_tokenizer(saved_tokenizer)
        except UserError as err:
            raise ConfigError(
                f"--use-checkpoint-args: the tokenizer {cfg.train.load} was trained with cannot "
                f"be loaded ({err}); name one with the tokenizer flags"
            ) from None


def device_of(train) -> torch.device:
    if train.device:
        return torch.device(train.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check(cfg, world_size: int) -> None:
    """ConfigError (one line) on the first problem; fills in what the flags leave open (the
    vocabulary size from the tokenizer, the model shape with --use-checkpoint-args)."""
    m, par, train = cfg.model, cfg.parallel, cfg.train
    vocab_flag = m.vocab_size  # --vocab-size as given, before a checkpoint's shape replaces it
    if train.use_checkpoint_args:
        if not train.load:
            raise ConfigError("--use-checkpoint-args needs --load DIR")
        use_checkpoint_args(cfg)
    check_compat(cfg.megatron, m.position_embedding_type, cfg.parallel.use_megatron_fsdp)
    dp = check_layout_flags(cfg, world_size)
    _check_noise_scale(train, par, dp)
    check_profile_flags(train)
    check_wandb_flags(train)
    cfg.optimizer.validate(train.train_iters, train.train_samples, train.global_batch(dp))
    _check_device(train)
    _check_data(cfg, vocab_flag)
    _check_outputs(train)
    if train.load and megatron_latest(train.load) is None:
        iteration = find_latest(train.load)  # a broken latest file is reported now
        if iteration is not None:  # files present with their sizes; checksums in the ranks
            verify_checkpoint(iteration_dir(train.load, iteration), digests=False)


def check_layout_flags(cfg, world_size: int) -> int:
    """The checks of a layout that need no data or files (sizes against the world and the
    model, context parallelism, pipeline stages and schedule, the batch split, the run's
    length); returns the data-parallel size. tools/plan.py validates the layouts it shows
    with this."""
    m, par, train = cfg.model, cfg.parallel, cfg.train
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    if par.sequence_parallel and tp == 1:
        par.sequence_parallel = False  # nothing to split, as in Megatron-LM
    dp = check_layout(world_size, tp, pp, cp=par.context_parallel_size)
    m.validate(tp, par.sequence_parallel)
    _check_context_parallel(m, par)
    par.validate(m.num_layers)
    train.validate()
    train.resolve_length(dp, m.seq_length)
    _check_pipeline(cfg, dp)
    return dp


def _check_noise_scale(train, par, dp: int) -> None:
    """The noise scale needs each DP rank's whole own gradient of a step: two or more DP
    ranks, no CP (a CP rank's gradient covers part of each sequence), and gradients reduced
    once per step (not sharded every micro-batch)."""
    if not train.log_gradient_noise_scale:
        return
    flag = "--log-gradient-noise-scale"
    if dp < 2:
        raise ConfigError(
            f"{flag} compares each data-parallel rank's gradient with their "
            "mean: it needs a data-parallel size of 2 or more"
        )
    if par.context_parallel_size > 1:
        raise ConfigError(f"{flag} is not available with --context-parallel-size above 1")
    if par.sharding_strategy() in ("optim_grads", "optim_grads_params"):
        raise ConfigError(
            f"{flag} is not available with --data-parallel-sharding-strategy "
            f"{par.sharding_strategy()} (gradients are reduced every micro-batch); use optim"
        )


def _check_context_parallel(m, par) -> None:
    """The sequence splits into 2 x CP chunks (and each CP rank's part over TP under SP);
    the comm types fit the layers and the heads."""
    cp, tp, types = par.context_parallel_size, par.tensor_model_parallel_size, par.cp_comm_type
    if len(types) not in (1, m.num_layers):
        raise ConfigError(
            f"--cp-comm-type: {len(types)} values for {m.num_layers} layers; give one value, or "
            "one per layer"
        )
    if "a2a+p2p" in types:
        raise ConfigError(
            "--cp-comm-type a2a+p2p: hierarchical context parallelism is not available in this "
            "engine; use p2p, a2a or allgather"
        )
    if cp == 1:
        return
    if m.seq_length % (2 * cp):
        raise ConfigError(
            f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size {cp} "
            f"(each CP rank holds two chunks of every sequence); use a multiple of {2 * cp}"
        )
    if par.sequence_parallel and (m.seq_length // cp) % tp:
        raise ConfigError(
            f"--seq-length {m.seq_length} / --context-parallel-size {cp} is not divisible by "
            f"--tensor-model-parallel-size {tp} (--sequence-parallel splits each CP rank's part)"
        )
    if m.attention_dropout > 0 and set(types) - {"a2a"}:
        raise ConfigError(
            f"--attention-dropout {m.attention_dropout}: dropout inside context-parallel "
            "attention is available with --cp-comm-type a2a only; pass --attention-dropout 0.0 "
            "(as Megatron-LM's Llama examples do) or --cp-comm-type a2a"
        )
    if "a2a" in types:
        for flag, count in (
            ("--num-attention-heads", m.num_attention_heads),
            ("key/value groups (--num-query-groups)", m.query_groups),
        ):
            if (count // tp) % cp:
                raise ConfigError(
                    f"--cp-comm-type a2a: {flag} {count} / --tensor-model-parallel-size {tp} "
                    f"is not divisible by --context-parallel-size {cp}; use p2p or allgather"
                )


def _check_pipeline(cfg, dp: int) -> None:
    m, par, train = cfg.model, cfg.parallel, cfg.train
    pp = par.pipeline_model_parallel_size
    virtual = par.virtual_size(m.num_layers)
    for rank in range(pp):
        stage_layers(
            m.num_layers,
            pp,
            rank,
            virtual,
            par.decoder_first_pipeline_num_layers,
            par.decoder_last_pipeline_num_layers,
            PLACEMENT.get(par.pipeline_schedule, "loop"),
        )
    if par.pipeline_schedule in SPLIT_BACKWARD and not par.gradient_accumulation_fusion:
        raise ConfigError(
            f"--pipeline-schedule {par.pipeline_schedule} defers the weight-gradient GEMMs that "
            "add into the fp32 gradient buffer, which --no-gradient-accumulation-fusion turns "
            "off (every W would be empty): drop that flag or use 1f1b"
        )
    schedule = train.batch_schedule(dp, m.seq_length)
    batches, _ = schedule.sizes(train.train_iters)
    for batch in sorted(batches | {schedule.final}):
        microbatches = train.num_microbatches(dp, batch)
        fewest = min_microbatches(par.pipeline_schedule, pp)
        if microbatches < fewest:
            rule = "2 x pipeline-model-parallel-size" + (" - 1" if fewest % 2 else "")
            raise ConfigError(
                f"--pipeline-schedule {par.pipeline_schedule} needs at least {rule} = {fewest} "
                f"micro-batches per step ({microbatches} = global batch {batch} / "
                f"(micro-batch-size x data-parallel size {dp}))"
            )
        if virtual > 1 and microbatches % pp and par.pipeline_schedule not in V_SHAPED:
            raise ConfigError(
                f"interleaved pipelining needs the micro-batches per step ({microbatches} = "
                f"global batch {batch} / (micro-batch-size x data-parallel size {dp})) to be a "
                f"multiple of pipeline-model-parallel-size {pp}"
            )


def _check_device(train) -> None:
    if train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but no CUDA device is available")
    if train.use_fused_kernels and device_of(train).type != "cuda":
        raise ConfigError(
            "--use-fused-kernels needs a CUDA device; drop it (the PyTorch ops run on CPU)"
        )
    if train.transformer_impl == "transformer_engine":
        check_transformer_engine()


def check_transformer_engine() -> None:
    """--transformer-impl transformer_engine: refused with the reason, never half-used."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--transformer-impl transformer_engine: Transformer Engine is not importable; "
            "install it (NVIDIA's transformer-engine) or use --transformer-impl local"
        ) from None
    raise ConfigError(
        "--transformer-impl transformer_engine: Transformer Engine is installed, but its layers "
        "are not wired into this engine yet; use --transformer-impl local (with "
        "--use-fused-kernels for the fused norms, RoPE, SwiGLU and cross-entropy)"
    )


def _check_data(cfg, vocab_flag: int | None) -> None:
    """The tokenizer loads; the datasets exist and are well formed, the split leaves the train
    split documents with at least one sample's worth of tokens, and every token id fits the
    vocabulary."""
    m, data = cfg.model, cfg.data
    cfg.tokenizer = cfg.tokenizer.with_vocab_size(vocab_flag)
    tokenizer = build_tokenizer(cfg.tokenizer)
    if m.vocab_size is None or cfg.tokenizer.vocab_size is not None:
        m.vocab_size = tokenizer.vocab_size  # NullTokenizer / TikTokenizer: theirs is the flag's
        source = tokenizer.source
    elif m.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"--vocab-size {m.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
        )
    else:
        source = f"--vocab-size {m.vocab_size}"
    data.validate()
    if data.mock_data:
        if data.data_path or data.per_split_paths:
            raise ConfigError(
                "--mock-data generates its documents; drop --data-path and the per-split paths"
            )
        return
    if not data.data_path and not data.per_split_paths:
        raise ConfigError(
            "--data-path is required (a dataset prefix or weight/prefix pairs), or --mock-data "
            "to try the run on generated documents"
        )
    blends, shares = split_blends(data.data_path, data.split, data.per_split_paths)
    if data_format(data.data_path or data.train_data_path, data.data_format) == "parquet":
        if data.per_split_paths:
            raise ConfigError(
                "--train/valid/test-data-path: Parquet sources are cut by --split; give them "
                "with --data-path"
            )
        _check_parquet(data, list(blends[0].prefixes))
        return
    datasets: dict[str, IndexedDataset] = {}
    try:
        for prefix in dict.fromkeys(p for b in blends if b for p in b.prefixes):
            datasets[prefix] = IndexedDataset(prefix)
            check_token_ids(datasets[prefix], m.vocab_size, source, data.data_cache_path)
        _check_split_shares(data, blends, shares, datasets)
    finally:
        for dataset in datasets.values():
            dataset.close()


def _check_split_shares(data, blends, shares, datasets: dict[str, IndexedDataset]) -> None:
    """Each split that has paths gets a share of every dataset of its blend (megatron-core
    stops on an assertion otherwise), and the train split holds tokens (a small split is
    repeated for as many epochs as the run needs, but an empty one gives nothing)."""
    cut_by = "the per-split paths" if data.per_split_paths else f"--split {data.split}"
    for k, (blend, share) in enumerate(zip(blends, shares)):
        if blend is None or share is None:
            if k == 0:
                raise ConfigError(f"{cut_by} gives the train split nothing; give it a share")
            continue
        weights = blend.weights or [1.0] * len(blend.prefixes)
        tokens = {}
        for weight, prefix in zip(weights, blend.prefixes):
            if weight > 0:
                lengths = datasets[prefix].sequence_lengths
                start, end = sequence_range(len(lengths), share)
                tokens[prefix] = int(lengths[start:end].sum())
        empty = [prefix for prefix, count in tokens.items() if count == 0]
        if k > 0 and len(empty) == len(tokens):
            continue  # a valid/test share too small for every dataset: that split is skipped
        if empty:
            raise ConfigError(
                f"{cut_by} gives the {SPLIT_NAMES[k]} split no tokens of {empty[0]}; raise "
                "that split's share or more data, or leave that dataset out of the blend"
            )


def _check_parquet(data, sources: list[str]) -> None:
    """Every shard opens and holds the text column; the buffer is a positive row count.
    (Whether the documents hold enough tokens shows only once they are tokenized.)"""
    if data.parquet_shuffle_buffer < 1:
        raise ConfigError(
            f"--parquet-shuffle-buffer {data.parquet_shuffle_buffer}: need at least 1 row"
        )
    for source in sources:
        open_shards(source, data.parquet_text_column)


def _writable_dir(path: str, flag: str) -> None:
    """The folder exists (created if needed) and a file can be created in it."""
    try:
        probe_writable_folder(path)
    except OSError as err:
        raise ConfigError(f"{flag}: {describe_os_error(err, path, writing=True)}") from None


def _check_outputs(train) -> None:
    """Every place the run writes to can be written, found now rather than at the first
    checkpoint or log line."""
    if train.save:
        _writable_dir(train.save, "--save")
    if train.tensorboard_dir:
        _writable_dir(train.tensorboard_dir, "--tensorboard-dir")
    if train.wandb_project:
        _writable_dir(wandb_folder(train), "--wandb-save-dir" if train.wandb_save_dir else "--save")
    if train.log_jsonl:
        _writable_dir(os.path.dirname(os.path.abspath(train.log_jsonl)), "--log-jsonl")
        if os.path.isdir(train.log_jsonl):
            raise ConfigError(f"--log-jsonl {train.log_jsonl} is a folder; give a file name")
