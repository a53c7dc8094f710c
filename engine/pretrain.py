"""Pretraining entry point: `python -m engine.pretrain <Megatron-LM flags>`, launched by
torchrun (see examples/pretrain_gpt.sh). `main(argv)` parses and checks every flag before any
process group starts, then sets up the run and trains.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from engine.arguments import parse_configs
from engine.checkpointing import find_latest, iteration_dir, read_meta
from engine.cli import run_main
from engine.config import DataConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
from engine.data.blended import parse_data_path
from engine.data.indexed import IndexedDataset
from engine.data.tokenizer import build_tokenizer
from engine.errors import ConfigError
from engine.training import Configs, NaNLimit, finish, setup, train
from parallel.pipeline.layout import stage_layers
from parallel.state import ParallelState, check_layout, init_distributed

GROUPS = [
    (ModelConfig, "model"),
    (ParallelConfig, "parallelism"),
    (OptimizerConfig, "optimizer, learning rate, loss scaling"),
    (DataConfig, "data"),
    (TrainConfig, "training, evaluation, logging, checkpoints"),
]


def parse(argv: list[str] | None) -> Configs:
    configs = parse_configs(argv, GROUPS, description=__doc__)
    return Configs(*(configs[cls] for cls, _ in GROUPS))


# Fields that define the model's tensors; --use-checkpoint-args takes them from the checkpoint.
ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "kv_channels",
    "max_position_embeddings",
    "vocab_size",
    "position_embedding_type",
    "rotary_base",
    "normalization",
    "norm_epsilon",
    "swiglu",
    "openai_gelu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "qk_layernorm",
)


def use_checkpoint_args(cfg: Configs) -> None:
    iteration = find_latest(cfg.train.load)
    if iteration is None:
        raise ConfigError(f"--use-checkpoint-args: no checkpoint in {cfg.train.load}")
    saved = read_meta(iteration_dir(cfg.train.load, iteration))["model"]
    for name in ARCHITECTURE_FIELDS:
        setattr(cfg.model, name, saved[name])


def check(cfg: Configs, world_size: int) -> None:
    """Every check that needs no process group: ConfigError (one line) on the first problem."""
    m, par, train, data = cfg.model, cfg.parallel, cfg.train, cfg.data
    if train.use_checkpoint_args:
        if not train.load:
            raise ConfigError("--use-checkpoint-args needs --load DIR")
        use_checkpoint_args(cfg)
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    if par.sequence_parallel and tp == 1:
        par.sequence_parallel = False  # nothing to split, as in Megatron-LM
    dp = check_layout(world_size, tp, pp)
    if not data.data_path:
        raise ConfigError("--data-path is required (a dataset prefix or weight/prefix pairs)")
    tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model)
    if m.vocab_size is None:
        m.vocab_size = tokenizer.vocab_size
    elif m.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"--vocab-size {m.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
        )
    for prefix in parse_data_path(data.data_path)[1]:
        dataset = IndexedDataset(prefix)
        dataset.close()
    m.validate(tp, par.sequence_parallel)
    par.validate(m.num_layers)
    cfg.optimizer.validate(train.train_iters)
    train.validate()
    microbatches = train.num_microbatches(dp)
    virtual = par.virtual_size(m.num_layers)
    for rank in range(pp):
        stage_layers(
            m.num_layers,
            pp,
            rank,
            virtual,
            par.decoder_first_pipeline_num_layers,
            par.decoder_last_pipeline_num_layers,
        )
    if virtual > 1 and microbatches % pp:
        raise ConfigError(
            f"interleaved pipelining needs the micro-batches per step ({microbatches} = "
            f"global-batch-size / (micro-batch-size x data-parallel size {dp})) to be a "
            f"multiple of pipeline-model-parallel-size {pp}"
        )
    if train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but no CUDA device is available")
    if train.use_fused_kernels and _device(train).type != "cuda":
        raise ConfigError(
            "--use-fused-kernels needs a CUDA device; drop it (the PyTorch ops run on CPU)"
        )
    if train.transformer_impl == "transformer_engine":
        check_transformer_engine()
    if train.load:
        find_latest(train.load)  # a broken latest file is reported now, on one line


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


def _device(train: TrainConfig) -> torch.device:
    if train.device:
        return torch.device(train.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check(cfg, world_size)
    device = _device(cfg.train)
    started_here = not dist.is_initialized()
    _, _, device = init_distributed(device, cfg.parallel.distributed_timeout_minutes)
    if device.type == "cpu":  # ranks sharing a CPU get one core each
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
    state = ParallelState.build(
        cfg.parallel.tensor_model_parallel_size,
        cfg.parallel.pipeline_model_parallel_size,
        device=device,
        timeout_minutes=cfg.parallel.distributed_timeout_minutes,
    )
    run = setup(cfg, state)
    code = 0
    try:
        train(run)
    except NaNLimit as stop:
        run.writer.print(str(stop))
        code = 1
    finish(run)
    if started_here and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    run_main(main)
