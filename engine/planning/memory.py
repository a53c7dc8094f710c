"""Model state a rank holds for a layout, predicted without building the model: the
parameters of its share of the layers (engine/model/: the embedding on the first pipeline
stage, the final norm and output layer on the last, TP-split weights divided by the TP
size), times the bytes per parameter of its data-parallel sharding strategy
(engine/state_memory.py's formula, the one its measurement is checked against).

Counted as the engine lays a decoder out: per layer an input norm, the fused QKV (and its
bias with --add-bias-linear or --add-qkv-bias), optional per-head query/key norms, the output
projection, a pre-MLP norm and the MLP (SwiGLU doubles its first projection). Column-parallel
weights and biases are split over TP; row-parallel biases, norms and learned positions are
whole on every TP rank. With tied embeddings the last stage holds its own copy of the word
embeddings when it is not also the first.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.state_memory import formula_bytes_per_param
from parallel.pipeline.layout import stage_layers

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    virtual: int = 1
    strategy: str = "no_shard"  # --data-parallel-sharding-strategy (distributed optimizer: optim)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None


def _norm(cfg: ModelConfig, size: int) -> int:
    return size * (2 if cfg.normalization == "LayerNorm" else 1)


def layer_parameters(cfg: ModelConfig, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank."""
    h, n, g, d = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    f = cfg.ffn_size
    qkv_out = (n + 2 * g) * d
    count = _norm(cfg, h) * 2  # input and pre-MLP norms
    count += h * qkv_out // tp + (qkv_out // tp if cfg.add_bias_linear or cfg.add_qkv_bias else 0)
    if cfg.qk_layernorm:
        count += 2 * _norm(cfg, d)
    count += n * d // tp * h + (h if cfg.add_bias_linear else 0)
    fc1 = f * (2 if cfg.swiglu else 1)
    count += h * fc1 // tp + (fc1 // tp if cfg.add_bias_linear else 0)
    count += f // tp * h + (h if cfg.add_bias_linear else 0)
    return count


def check_layout(cfg: ModelConfig, layout: Layout, pp_rank: int) -> None:
    """ConfigError, as the engine would refuse the layout (and a stage outside it)."""
    cfg.validate(layout.tp)
    if layout.strategy not in STRATEGIES:
        raise ConfigError(f"sharding strategy {layout.strategy!r} is not one of {STRATEGIES}")
    if layout.virtual > 1 and layout.pp < 2:
        raise ConfigError("virtual pipeline stages need pipeline-model-parallel-size >= 2")
    if not 0 <= pp_rank < layout.pp:
        raise ConfigError(f"pipeline stage {pp_rank} is outside {layout.pp} stages")


def rank_parameters(cfg: ModelConfig, layout: Layout, pp_rank: int) -> int:
    """Parameters held by one (any) TP rank of pipeline stage `pp_rank`."""
    check_layout(cfg, layout, pp_rank)
    tp, h = layout.tp, cfg.hidden_size
    chunks = stage_layers(
        cfg.num_layers,
        layout.pp,
        pp_rank,
        layout.virtual,
        layout.first_stage_layers,
        layout.last_stage_layers,
    )
    count = sum(len(layers) for layers in chunks) * layer_parameters(cfg, tp)
    vocab = cfg.padded_vocab_size(tp) * h // tp
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    if first:
        count += vocab
        if cfg.position_embedding_type == "learned_absolute":
            count += cfg.max_positions * h
    if last:
        count += _norm(cfg, h)
        if cfg.untie_embeddings_and_output_weights or not first:
            count += vocab  # the output layer, or the tied embedding's copy on the last stage
    return count


def rank_state_bytes(cfg: ModelConfig, layout: Layout, pp_rank: int) -> dict[str, float]:
    """{params, grads, optimizer}: bytes one rank of stage `pp_rank` holds (bf16 parameters,
    fp32 main gradients, Adam with fp32 masters)."""
    count = rank_parameters(cfg, layout, pp_rank)
    per = formula_bytes_per_param(layout.strategy, layout.dp)
    return {kind: count * b for kind, b in per.items()}
