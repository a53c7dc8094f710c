"""The engine's flags (Megatron-LM's names) that run a planned layout."""

from __future__ import annotations

import dataclasses

from engine.config.arguments import flag_of
from engine.config.model import ModelConfig
from engine.planning.memory import Layout


def model_flags(cfg: ModelConfig) -> list[str]:
    """The flags that give a ModelConfig (the required ones and those that differ from the
    defaults), so a model
    read from a Hugging Face config or a checkpoint can be launched and checked as flags."""
    default = ModelConfig()
    flags: list[str] = []
    for field in dataclasses.fields(ModelConfig):
        value = getattr(cfg, field.name)
        if "help" not in field.metadata:
            continue
        if value == getattr(default, field.name) and not field.metadata.get("required"):
            continue
        if isinstance(value, bool):
            if value == (field.metadata.get("action", "store_true") == "store_true"):
                flags.append(flag_of(field))
            continue
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        flags += [flag_of(field), *map(str, values)]
    return flags


def layout_flags(cfg: ModelConfig, layout: Layout) -> list[str]:
    """Flags for the layout's parallel sizes (expert ones included), batch split, schedule,
    sharding, optimizer, overlap and cfg's recomputation; the model's own flags are the
    caller's."""
    flags = [
        "--tensor-model-parallel-size", str(layout.tp),
        "--pipeline-model-parallel-size", str(layout.pp),
        "--context-parallel-size", str(layout.cp),
        "--micro-batch-size", str(layout.micro_batch_size),
        "--global-batch-size",
        str(layout.micro_batch_size * layout.num_microbatches * layout.dp),
    ]  # fmt: skip
    if layout.ep > 1:
        flags += ["--expert-model-parallel-size", str(layout.ep)]
    if layout.etp is not None:
        flags += ["--expert-tensor-parallel-size", str(layout.etp)]
    if layout.sequence_parallel and layout.tp > 1:
        flags.append("--sequence-parallel")
    if layout.virtual > 1:
        per_chunk = cfg.num_layers // (layout.pp * layout.virtual)
        flags += ["--num-layers-per-virtual-pipeline-stage", str(per_chunk)]
    if layout.schedule is not None:
        flags += ["--pipeline-schedule", layout.schedule]
    if layout.strategy == "optim":
        flags.append("--use-distributed-optimizer")
    elif layout.strategy != "no_shard":
        flags += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", layout.strategy]
    if layout.optimizer != "adam":
        flags += ["--optimizer", layout.optimizer]
        if layout.optimizer == "muon" and layout.tp > 1:
            flags += ["--muon-tp-mode", layout.muon_tp_mode]
    if layout.overlap_grad_reduce:
        flags.append("--overlap-grad-reduce")
    if layout.overlap_param_gather:
        flags.append("--overlap-param-gather")
    if cfg.recompute_granularity:
        flags += ["--recompute-granularity", cfg.recompute_granularity]
    if cfg.recompute_method:
        flags += ["--recompute-method", cfg.recompute_method]
        flags += ["--recompute-num-layers", str(cfg.recompute_num_layers)]
    return flags
