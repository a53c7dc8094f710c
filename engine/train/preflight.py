"""Every check of a pretraining configuration that needs no process group.

`prepare(cfg, world_size)` resolves the parsed configs (engine/config/resolve.py: the one
writer of what is derived) and checks them: first what reads only the configs
(engine/config/checks.py), then what reads the world outside them (the device, the
profiler's and wandb's needs, the tokenizer, the data files, the split, token ids against the
vocabulary, the places the run writes to, the checkpoint to resume from: complete, every file
its recorded size). It runs in each rank before the process group starts, and in the
launcher (engine/launch.py) once before any rank starts, so that a wrong flag, layout, path,
split, tokenizer or checkpoint is one line and exit code 2 instead of a traceback per rank.
"""

from __future__ import annotations

import os

import torch

from engine.checkpoint import run_lock
from engine.checkpoint.files import find_latest, iteration_dir, read_meta
from engine.checkpoint.load import verify_checkpoint
from engine.config.checks import check_configs
from engine.config.configs import Configs
from engine.config.model import ARCHITECTURE_FIELDS, ModelConfig
from engine.config.resolve import SavedArchitecture, resolve
from engine.config.tokenizer import TokenizerConfig, config_from_record
from engine.data.fim import fim_tokens
from engine.data.indexed.dataset import IndexedDataset
from engine.data.indexed.gpt_dataset import SPLIT_NAMES, sequence_range
from engine.data.prepare.token_ids import check_document_boundaries, check_token_ids
from engine.data.sources import DataSources, sources_of
from engine.data.streaming.shards import open_shards
from engine.data.tokenizers import build_tokenizer
from engine.errors import ConfigError, UserError
from engine.files.outputs import probe_writable_folder
from engine.interop.megatron.checkpoint import megatron_latest, megatron_progress
from engine.interop.megatron.layout import model_config_from_args
from engine.monitor import wandb as wandb_monitor
from parallel.errors import describe_os_error
from parallel.state import local_rank_and_size, rank_device


def prepare(cfg: Configs, world_size: int, local_world_size: int | None = None) -> Configs:
    """The configs resolved (engine/config/resolve.py, with what --load's checkpoint and the
    tokenizer say) and checked for a run on `world_size` ranks, `local_world_size` of them on
    each node (default: this process's node, from torchrun's environment); ConfigError (one
    line) on the first problem."""
    resolved = resolve(cfg, world_size, saved_architecture(cfg), _vocab_size)
    check(resolved, world_size, local_world_size)
    return resolved


def _vocab_size(tokenizer: TokenizerConfig) -> int:
    return build_tokenizer(tokenizer).vocab_size


def saved_architecture(cfg: Configs) -> SavedArchitecture | None:
    """With --use-checkpoint-args: the model's shape and the tokenizer of --load's latest
    checkpoint (ours or Megatron-LM's); None without it."""
    load = cfg.checkpointing.load
    if not cfg.checkpointing.use_checkpoint_args:
        return None
    if not load:
        raise ConfigError("--use-checkpoint-args needs --load DIR")
    megatron = megatron_latest(load)
    if megatron is not None:
        return _megatron_architecture(megatron)
    iteration = find_latest(load)
    if iteration is None:
        raise ConfigError(f"--use-checkpoint-args: no checkpoint in {load}")
    meta = read_meta(iteration_dir(load, iteration))
    saved_tokenizer = config_from_record(meta)
    if cfg.tokenizer == TokenizerConfig() and saved_tokenizer is not None:
        try:  # no tokenizer flags given: the run continues with the saved one
            build_tokenizer(saved_tokenizer)
        except UserError as err:
            raise ConfigError(
                f"--use-checkpoint-args: the tokenizer {load} was trained with cannot be loaded "
                f"({err}); name one with the tokenizer flags"
            ) from None
    return SavedArchitecture(
        ModelConfig.from_record(meta["model"]), ARCHITECTURE_FIELDS, saved_tokenizer
    )


def _megatron_architecture(path: str) -> SavedArchitecture:
    """A Megatron-LM checkpoint's shape from its saved arguments (its padded vocabulary is the
    vocabulary, as its softmax covers every padded row)."""
    args = megatron_progress(path)["args"]
    if args is None:
        raise ConfigError(
            f"--use-checkpoint-args: {path}/common.pt holds no saved arguments; give the model's "
            "flags instead"
        )
    fields = (*ARCHITECTURE_FIELDS, "make_vocab_size_divisible_by", "rotary_percent")
    return SavedArchitecture(model_config_from_args(args), fields)


def check(cfg: Configs, world_size: int, local_world_size: int | None = None) -> None:
    """Every check of resolved configs (engine/config/checks.py's, then those that read
    devices, files, the tokenizer and the checkpoint); ConfigError (one line) on the first
    problem. Reads only."""
    check_configs(cfg, world_size)
    _check_profiler(cfg.profiling, cfg.logging)
    _check_wandb(cfg.logging, cfg.checkpointing)
    _check_device(cfg.runtime, local_world_size)
    _check_data(cfg)
    _check_outputs(cfg.logging, cfg.checkpointing)
    if cfg.resilience.heartbeat_dir:
        _writable_dir(cfg.resilience.heartbeat_dir, "--heartbeat-dir")
    load = cfg.checkpointing.load
    if load and megatron_latest(load) is None:
        iteration = find_latest(load)  # a broken latest file is reported now
        if iteration is not None:  # files present with their sizes; checksums in the ranks
            meta = verify_checkpoint(iteration_dir(load, iteration), digests=False)
            if not cfg.checkpointing.finetune:
                _check_same_tokenizer(cfg.tokenizer, meta, iteration_dir(load, iteration))
        elif cfg.checkpointing.exit_on_missing_checkpoint:
            raise ConfigError(
                f"--exit-on-missing-checkpoint: no checkpoint in {load}; nothing trained "
                "(leave the flag out to start from scratch there)"
            )


def _check_same_tokenizer(tokenizer: TokenizerConfig, meta: dict, path: str) -> None:
    """A resumed run tokenizes as the run it continues (the same ids for the same text), or
    its data positions and embeddings mean other things; checkpoints from before the record
    pass."""
    saved = meta.get("tokenizer_identity")
    if saved is not None and saved != build_tokenizer(tokenizer).identity():
        raise ConfigError(
            f"--load {path} was trained with another tokenizer than the one the tokenizer flags "
            "name (they encode the same text differently); give the run's tokenizer, or "
            "--finetune to start a new run from its weights"
        )


def _check_device(runtime, local_world_size: int | None) -> None:
    """Every rank of a node gets its own device (the last one is checked, as the launcher
    knows the node's process count), and what needs CUDA has it."""
    local_rank, local_world = local_rank_and_size()
    if local_world_size is not None:
        local_rank, local_world = local_world_size - 1, local_world_size
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = rank_device(runtime.device, local_rank, local_world, cuda)
    if runtime.deterministic_mode and device.type == "cuda":
        _check_deterministic_gpu(runtime)
    backend = runtime.distributed_backend
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            "--distributed-backend nccl needs CUDA GPUs and this run is on the CPU: use gloo "
            "or leave the flag out (the backend follows the device)"
        )
    if backend == "gloo" and device.type == "cuda":
        raise ConfigError(
            "--distributed-backend gloo: on GPUs this engine's collectives run over NCCL "
            "(gloo lacks some of them for CUDA tensors): use nccl, or add --device cpu"
        )
    if runtime.use_fused_kernels and device.type != "cuda":
        raise ConfigError(
            "--use-fused-kernels needs a CUDA device; drop it (the PyTorch ops run on CPU)"
        )
    if runtime.transformer_impl == "transformer_engine":
        check_transformer_engine()
    if runtime.fp8 is not None:
        from engine.ops.fp8.apply import fp8_recipe
        from engine.ops.fp8.probe import check_fp8_device

        check_fp8_device(fp8_recipe(runtime), device)


NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")  # Megatron-LM's list


def _check_deterministic_gpu(runtime) -> None:
    """--deterministic-mode on GPUs, as Megatron-LM checks it: NCCL_ALGO names a fixed
    all-reduce algorithm, and no fused kernel (they are not known to be deterministic)."""
    if os.environ.get("NCCL_ALGO") not in NCCL_ALGOS:
        raise ConfigError(
            f"--deterministic-mode: set NCCL_ALGO to one of {', '.join(NCCL_ALGOS)} (NCCL "
            "picks an all-reduce algorithm per call otherwise, as Megatron-LM requires too)"
        )
    if runtime.use_fused_kernels:
        raise ConfigError(
            "--deterministic-mode with --use-fused-kernels: the fused kernels are not known to "
            "be deterministic; drop --use-fused-kernels (the PyTorch ops run)"
        )


def _check_profiler(profiling, logging) -> None:
    """torch.profiler (--use-pytorch-profiler, or any run without a GPU) writes its trace
    beside --tensorboard-dir."""
    torch_profiler = profiling.use_pytorch_profiler or not torch.cuda.is_available()
    if profiling.profile and torch_profiler and not logging.tensorboard_dir:
        raise ConfigError(
            "--profile with torch.profiler (--use-pytorch-profiler, or any run without a GPU) "
            "writes its trace beside --tensorboard-dir; give --tensorboard-dir DIR"
        )


def _check_wandb(logging, checkpointing) -> None:
    """--wandb-project can be honoured: wandb imports, and the run has a folder for it."""
    if not logging.wandb_project:
        return
    if not wandb_monitor.wandb_importable():
        raise ConfigError(
            "--wandb-project: wandb is not importable; `pip install wandb` (WANDB_MODE=offline "
            "logs without network) or drop the --wandb-* flags"
        )
    if not logging.wandb_save_dir and not checkpointing.save:
        raise ConfigError(
            "--wandb-project needs a folder for the run: give --wandb-save-dir DIR or --save DIR "
            "(its wandb/ subfolder is used)"
        )


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


def _check_data(cfg: Configs) -> None:
    """The tokenizer loads and fits the vocabulary; the datasets exist and are well formed,
    the split leaves the train split documents with at least one sample's worth of tokens,
    and every token id fits the vocabulary."""
    m, data = cfg.model, cfg.data
    tokenizer = build_tokenizer(cfg.tokenizer)
    if m.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"--vocab-size {m.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
        )
    # the vocabulary is the tokenizer's unless --vocab-size (or the checkpoint) gave it to a
    # family that does not read it
    given = "--vocab-size" in cfg.given or cfg.checkpointing.use_checkpoint_args
    source = tokenizer.source
    if given and cfg.tokenizer.vocab_size is None:
        source = f"--vocab-size {m.vocab_size}"
    if data.mock_data and (data.data_path or data.per_split_paths):
        raise ConfigError(
            "--mock-data generates its documents; drop --data-path and the per-split paths"
        )
    sources = sources_of(data)
    _check_blend_for_dataset_gradients(cfg, sources)
    if cfg.evaluation.eval_tasks:  # a bad task file or a choice too long: one line, here
        from engine.train.setup import eval_tasks_of

        eval_tasks_of(cfg)
    if cfg.fim.fim_data:
        _check_fim(cfg.fim, sources.format, tokenizer)
    if sources.format == "mock":
        return
    if sources.format == "parquet":
        if sources.per_split:
            raise ConfigError(
                "--train/valid/test-data-path: Parquet sources are cut by --split; give them "
                "with --data-path"
            )
        _check_parquet(data, list(sources.train.prefixes))
        return
    datasets: dict[str, IndexedDataset] = {}
    try:
        for prefix in sources.prefixes():
            datasets[prefix] = IndexedDataset(prefix)
            check_token_ids(datasets[prefix], m.vocab_size, source, data.data_cache_path)
            check_document_boundaries(datasets[prefix], tokenizer.eod)
            if data.masks_documents:
                _check_documents_end(datasets[prefix], prefix, tokenizer.eod, data)
        _check_split_shares(sources, datasets)
    finally:
        for dataset in datasets.values():
            dataset.close()


def _check_blend_for_dataset_gradients(cfg: Configs, sources: DataSources) -> None:
    """--log-gradient-cosine-interval and --pcgrad compare the training blend's datasets."""
    flag = next((name for name, on in (
        ("--log-gradient-cosine-interval", cfg.logging.log_gradient_cosine_interval),
        ("--pcgrad", cfg.optimizer.pcgrad),
    ) if on), None)  # fmt: skip
    train = sources.train
    if flag and (train is None or len(train.prefixes) < 2):
        raise ConfigError(
            f"{flag} compares the gradients of the training blend's datasets, and the training "
            "data is one dataset; give a named blend (--data-path 0.6 web:PREFIX 0.4 "
            "code:PREFIX)"
        )


def _check_fim(fim, data_format: str, tokenizer) -> None:
    """--fim-data: preprocessed data, and a tokenizer with every FIM token."""
    if data_format != "indexed":
        what = "--mock-data" if data_format == "mock" else "Parquet streams"
        raise ConfigError(
            f"--fim-data rearranges preprocessed (.bin/.idx) samples; {what} are not (as in "
            "Megatron-LM); preprocess the data with tools/preprocess_data.py"
        )
    fim_tokens(fim, tokenizer)


def _check_documents_end(dataset: IndexedDataset, prefix: str, eod: int, data) -> None:
    """With the document flags, documents must end with the tokenizer's EOD, or there is
    nothing to reset at (data preprocessed without --append-eod, or with another tokenizer):
    the last token of the first documents is looked at."""
    flag = next(
        f"--{name.replace('_', '-')}"
        for name in ("reset_attention_mask", "reset_position_ids", "eod_mask_loss")
        if getattr(data, name)
    )
    count = min(dataset.num_documents, 64)
    ends = dataset.document_indices[1 : count + 1] - 1
    if count and not any(len(dataset[int(k)]) and int(dataset[int(k)][-1]) == eod for k in ends):
        raise ConfigError(
            f"{flag}: {prefix} has no end-of-document token (id {eod}, the tokenizer's) at the "
            f"end of its first {count} documents; preprocess it with --append-eod and this "
            "tokenizer, or drop the flag"
        )


def _check_split_shares(sources: DataSources, datasets: dict[str, IndexedDataset]) -> None:
    """Each split that has paths gets a share of every dataset of its blend (megatron-core
    stops on an assertion otherwise), and the train split holds tokens (a small split is
    repeated for as many epochs as the run needs, but an empty one gives nothing)."""
    cut_by = sources.cut_by
    for k, (blend, share) in enumerate(zip(sources.blends, sources.shares, strict=False)):
        if blend is None or share is None:
            if k == 0:
                raise ConfigError(f"{cut_by} gives the train split nothing; give it a share")
            continue
        weights = blend.weights or [1.0] * len(blend.prefixes)
        tokens = {}
        for weight, prefix in zip(weights, blend.prefixes, strict=False):
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


def _check_outputs(logging, checkpointing) -> None:
    """Every place the run writes to can be written, found now rather than at the first
    checkpoint or log line."""
    if checkpointing.save:
        _writable_dir(checkpointing.save, "--save")
        run_lock.check_free(checkpointing.save)  # held by rank 0 once the run starts
    if logging.tensorboard_dir:
        _writable_dir(logging.tensorboard_dir, "--tensorboard-dir")
    if logging.wandb_project:
        folder = wandb_monitor.wandb_folder(logging, checkpointing)
        _writable_dir(folder, "--wandb-save-dir" if logging.wandb_save_dir else "--save")
    if logging.log_jsonl:
        _writable_dir(os.path.dirname(os.path.abspath(logging.log_jsonl)), "--log-jsonl")
        if os.path.isdir(logging.log_jsonl):
            raise ConfigError(f"--log-jsonl {logging.log_jsonl} is a folder; give a file name")
