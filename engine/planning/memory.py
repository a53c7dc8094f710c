"""Model state a rank holds for a layout, predicted without building the model: the
parameters of its share of the layers (engine/model/: the embedding on the first pipeline
stage, the final norm and output layer on the last, TP-split weights divided by the TP
size), times the bytes per parameter of its data-parallel sharding strategy
(engine/planning/state_memory.py's formula, the one its measurement is checked against;
with Muon its weights' state as engine/planning/muon_terms.py counts it).

Counted as the engine lays a decoder out: per layer an input norm, the fused QKV (and its
bias with --add-bias-linear or --add-qkv-bias), optional per-head query/key norms, the output
projection, a pre-MLP norm and the MLP (SwiGLU doubles its first projection). Column-parallel
weights and biases are split over TP; row-parallel biases, norms and learned positions are
whole on every TP rank. With tied embeddings the last stage holds its own copy of the word
embeddings when it is not also the first. An MoE layer (--num-experts) holds the router, the
shared experts and its share of the routed experts in place of the MLP; the routed experts'
state is sharded over the expert data-parallel group (engine/planning/moe_terms.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.config.model import ModelConfig
from engine.errors import ConfigError
from engine.planning.activations import (
    ACTIVATION_BYTES,
    layers_activation_bytes,
    norm_bytes,
    stage_ends_activation_bytes,
)
from engine.planning.moe_terms import (
    dense_mlp_activation_bytes,
    dense_mlp_parameters,
    moe_mlp_activation_bytes,
    moe_mlp_dense_parameters,
    routed_expert_parameters,
)
from engine.planning.muon_terms import MUON_STATE_BYTES, StageShape, muon_parameters
from engine.planning.state_memory import formula_bytes_per_param
from parallel.pipeline.layout import stage_layers
from parallel.pipeline.schedules import peak_in_flight
from parallel.pipeline.tables import SPLIT_BACKWARD

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class Layout:
    """One way to lay a run out: the parallel sizes, the sharding strategy, the micro-batch
    and its count per step on a rank, and the pipeline schedule."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    virtual: int = 1
    strategy: str = "no_shard"  # --data-parallel-sharding-strategy (distributed optimizer: optim)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    cp: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    num_microbatches: int = 1
    schedule: str | None = None  # default: 1f1b (interleaved with virtual stages)
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False  # Megatron-LM's --tp-comm-overlap (Transformer Engine)
    fp32_wgrad_gemm: bool = False  # weight-gradient GEMMs accumulate into fp32 (Megatron-LM's
    # fused kernels); this engine's bf16 GEMM output is added into the fp32 buffer in a pass
    ep: int = 1  # --expert-model-parallel-size
    etp: int | None = None  # --expert-tensor-parallel-size (None: TP, megatron-core's default)
    optimizer: str = "adam"  # or "muon" (engine/planning/muon_terms.py)
    muon_tp_mode: str = "blockwise"  # --muon-tp-mode

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """The routed experts' data-parallel size: TP x CP x DP / (ETP x EP)."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def schedule_kind(self) -> str:
        return self.schedule or ("interleaved" if self.virtual > 1 else "1f1b")


def _norm(cfg: ModelConfig, size: int) -> int:
    return size * (2 if cfg.normalization == "LayerNorm" else 1)


def layer_parameters(cfg: ModelConfig, tp: int, moe: bool = False) -> int:
    """Parameters of one transformer layer on one TP rank, the routed experts of an MoE
    layer (`moe`) aside."""
    h, n, g, d = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    count = _norm(cfg, h) * 2  # input and pre-MLP norms
    if cfg.multi_latent_attention:
        count += _latent_attention_parameters(cfg, tp)
        mlp = moe_mlp_dense_parameters(cfg, tp) if moe else dense_mlp_parameters(cfg, tp)
        return count + mlp
    qkv_out = (n + 2 * g) * d
    count += h * qkv_out // tp + (qkv_out // tp if cfg.add_bias_linear or cfg.add_qkv_bias else 0)
    if cfg.qk_layernorm_across_heads:  # one weight over all heads, split with them
        count += (n + g) * d // tp
    elif cfg.qk_layernorm:
        count += 2 * _norm(cfg, d)
    count += n * d // tp * h + (h if cfg.add_bias_linear else 0)
    if moe:
        return count + moe_mlp_dense_parameters(cfg, tp)
    return count + dense_mlp_parameters(cfg, tp)


def _latent_attention_parameters(cfg: ModelConfig, tp: int) -> int:
    """Multi-latent attention's weights on one TP rank: replicated down projections and
    latent norms, up and output projections split with the heads, the output's bias."""
    count = sum(i * o // (tp if split else 1) for i, o, split in cfg.latent_projections())
    if cfg.qk_layernorm:
        count += _norm(cfg, cfg.kv_lora_rank) + _norm(cfg, cfg.q_lora_rank or 0)
    return count + (cfg.hidden_size if cfg.add_bias_linear else 0)


def check_layout(cfg: ModelConfig, layout: Layout, pp_rank: int) -> None:
    """ConfigError, as the engine would refuse the layout (and a stage outside it)."""
    cfg.validate(layout.tp)
    if layout.strategy not in STRATEGIES:
        raise ConfigError(f"sharding strategy {layout.strategy!r} is not one of {STRATEGIES}")
    if layout.optimizer not in ("adam", "muon"):
        raise ConfigError(f"optimizer {layout.optimizer!r}: the planner knows adam and muon")
    if layout.virtual > 1 and layout.pp < 2:
        raise ConfigError("virtual pipeline stages need pipeline-model-parallel-size >= 2")
    if layout.schedule in SPLIT_BACKWARD:
        raise ConfigError(
            f"the planner does not model the {layout.schedule} schedule yet (its deferred "
            "weight gradients, and the V placement of zb-v and dualpipe-v)"
        )
    if not 0 <= pp_rank < layout.pp:
        raise ConfigError(f"pipeline stage {pp_rank} is outside {layout.pp} stages")
    if (layout.ep > 1 or layout.etp is not None) and not cfg.is_moe:
        raise ConfigError("expert parallelism needs a mixture of experts (--num-experts)")
    folded = layout.tp * layout.cp * layout.dp
    if cfg.is_moe and (cfg.num_experts % layout.ep or folded % (layout.expert_tp * layout.ep)):
        raise ConfigError(
            f"EP {layout.ep} x ETP {layout.expert_tp} does not fold into TP x CP x DP "
            f"{folded} with {cfg.num_experts} experts"
        )


def chunk_layers(cfg: ModelConfig, layout: Layout, pp_rank: int) -> list[list[int]]:
    """The global layer numbers of each model chunk stage `pp_rank` holds."""
    return stage_layers(
        cfg.num_layers,
        layout.pp,
        pp_rank,
        layout.virtual,
        layout.first_stage_layers,
        layout.last_stage_layers,
    )


def chunk_layer_counts(cfg: ModelConfig, layout: Layout, pp_rank: int) -> list[int]:
    """Layers of each model chunk stage `pp_rank` holds."""
    return [len(layers) for layers in chunk_layers(cfg, layout, pp_rank)]


def stage_moe_layers(cfg: ModelConfig, layout: Layout, pp_rank: int) -> int:
    """MoE layers stage `pp_rank` holds."""
    pattern = cfg.moe_layer_pattern(cfg.num_layers)
    return sum(pattern[i] for layers in chunk_layers(cfg, layout, pp_rank) for i in layers)


def rank_parameters(cfg: ModelConfig, layout: Layout, pp_rank: int) -> int:
    """Parameters held by one (any) TP rank of pipeline stage `pp_rank`, routed experts
    included."""
    return sum(rank_parameter_groups(cfg, layout, pp_rank))


def rank_parameter_groups(cfg: ModelConfig, layout: Layout, pp_rank: int) -> tuple[int, int]:
    """(parameters reduced over DP x CP, routed experts' reduced over expert DP) one rank of
    stage `pp_rank` holds."""
    check_layout(cfg, layout, pp_rank)
    tp, h = layout.tp, cfg.hidden_size
    layers = sum(chunk_layer_counts(cfg, layout, pp_rank))
    moe = stage_moe_layers(cfg, layout, pp_rank)
    count = (layers - moe) * layer_parameters(cfg, tp)
    experts = 0
    if moe:
        count += moe * layer_parameters(cfg, tp, moe=True)
        experts = moe * routed_expert_parameters(cfg, layout.ep, layout.expert_tp)
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
        if cfg.mtp_depths:  # its layers, built as the decoder's last, and the embedding's copy
            moe_last = cfg.moe_layer_pattern(cfg.num_layers)[-1]
            depth = 3 * _norm(cfg, h) + 2 * h * h // tp + layer_parameters(cfg, tp, moe_last)
            count += cfg.mtp_depths * depth
            if moe_last:
                experts += cfg.mtp_depths * routed_expert_parameters(
                    cfg, layout.ep, layout.expert_tp
                )
            if cfg.untie_embeddings_and_output_weights and not first:
                count += vocab
    return count, experts


def rank_state_bytes(cfg: ModelConfig, layout: Layout, pp_rank: int) -> dict[str, float]:
    """{params, grads, optimizer}: bytes one rank of stage `pp_rank` holds (bf16 parameters,
    fp32 main gradients, Adam with fp32 masters); the routed experts' sharded over the
    expert data-parallel group."""
    dense, experts = rank_parameter_groups(cfg, layout, pp_rank)
    per = formula_bytes_per_param(layout.strategy, layout.dp * layout.cp)  # CP ranks shard too
    per_expert = formula_bytes_per_param(layout.strategy, layout.expert_dp)
    out = {kind: dense * b + experts * per_expert[kind] for kind, b in per.items()}
    if layout.optimizer == "muon":  # its weights' state: 8 bytes, not Adam's 12
        muon, muon_experts = muon_parameters(cfg, stage_shape(cfg, layout, pp_rank), layout.tp)
        for count, dp, adam in ((muon, layout.dp * layout.cp, per),
                                (muon_experts, layout.expert_dp, per_expert)):  # fmt: skip
            fewer = formula_bytes_per_param(layout.strategy, dp, MUON_STATE_BYTES)["optimizer"]
            out["optimizer"] += count * (fewer - adam["optimizer"])
    return out


def stage_shape(cfg: ModelConfig, layout: Layout, pp_rank: int) -> StageShape:
    """What of the model stage `pp_rank` holds, for engine/planning/muon_terms.py."""
    return StageShape(
        layers=sum(chunk_layer_counts(cfg, layout, pp_rank)),
        moe_layers=stage_moe_layers(cfg, layout, pp_rank),
        first=pp_rank == 0,
        last=pp_rank == layout.pp - 1,
        ep=layout.ep,
        etp=layout.expert_tp,
    )


def _chunk_activation_bytes(cfg: ModelConfig, layers: list[int], layout: Layout, shape) -> int:
    """Bytes one model chunk (its global layer numbers) keeps for one micro-batch: the dense
    layers' count, each MoE layer's MLP part in place of the dense MLP's (without full
    recomputation, which keeps only the groups' inputs)."""
    total = layers_activation_bytes(cfg, len(layers), *shape)
    moe = sum(cfg.moe_layer_pattern(cfg.num_layers)[i] for i in layers)
    if not moe or cfg.recompute_granularity == "full":
        return total
    tp, sp, mbs, _, cp = shape
    tokens = cfg.seq_length // cp * mbs
    rows = tokens // tp if sp and tp > 1 else tokens
    a = ACTIVATION_BYTES
    moe_mlp = moe_mlp_activation_bytes(cfg, tp, layout.ep, layout.expert_tp, rows, a, tokens)
    return total + moe * (moe_mlp - dense_mlp_activation_bytes(cfg, tp, tokens, a))


def _mtp_depth_bytes(cfg: ModelConfig, layout: Layout, shape, vocab: int) -> int:
    """One multi-token-prediction depth's bytes for one micro-batch (engine/model/
    multi_token.py): the token ids it embeds, the embedding's dropout mask, its three norms,
    the projection's input (2h wide), a layer built as the decoder's last, and a head as the
    last stage's (the output layer's input, logits, cross entropy) with the depth's loss mask."""
    tp, sp, mbs, mask_bytes, cp = shape
    a, h = ACTIVATION_BYTES, cfg.hidden_size
    tokens = cfg.seq_length // cp * mbs
    between = tokens // tp if sp and tp > 1 else tokens
    total = 8 * tokens + (mask_bytes * between * h if cfg.hidden_dropout else 0)
    if cfg.recompute_granularity == "full":  # rerun whole: only the embedded input is new
        total += a * between * h  # (the hidden one is the head's input before it)
    else:
        layer = _chunk_activation_bytes(cfg, [cfg.num_layers - 1], layout, shape)
        layer -= 2 * 4 * (cfg.seq_length // cp) * cfg.rotary_dim  # RoPE's: the stage's
        total += 3 * norm_bytes(cfg, between, h) + 2 * a * between * h + layer
    total += a * between * h + a * tokens * (vocab // tp) + 17 * tokens  # its head
    return total + 4 * tokens  # the depth's loss mask


def rank_activation_bytes(
    cfg: ModelConfig, layout: Layout, pp_rank: int, mask_bytes: int = 2
) -> int:
    """The most activation bytes stage `pp_rank` holds at once in a training step: its
    schedule's peak of chunk-micro-batches in flight (forward done, backward not yet), each
    holding its chunk's layers (cfg's recomputation), plus the embedding's bytes for those of
    the first model chunk on the first stage and the head's for those of the last chunk on the
    last stage (the interleaved schedule runs chunk (k // p) mod v as a rank's k-th forward).
    With full recomputation, backward's rerun of one group's forward comes on top of the
    in-flight bytes less that micro-batch's head (freed before the rerun)."""
    check_layout(cfg, layout, pp_rank)
    chunks = chunk_layers(cfg, layout, pp_rank)
    m, p, v = layout.num_microbatches, layout.pp, layout.virtual
    if p == 1 and v == 1:
        held = 1  # no pipelining: each micro-batch's backward follows its forward
    else:
        held = peak_in_flight(layout.schedule_kind, p, pp_rank, m, v)
    shape = (layout.tp, layout.sequence_parallel, layout.micro_batch_size, mask_bytes, layout.cp)
    total = held * max(_chunk_activation_bytes(cfg, layers, layout, shape) for layers in chunks)
    vocab = cfg.padded_vocab_size(layout.tp)
    head = 0
    for end, is_end, chunk in ((0, pp_rank == 0, 0), (1, pp_rank == p - 1, v - 1)):
        if is_end:
            of_chunk = sum(1 for k in range(held) if (k // p) % v == chunk)
            ends = stage_ends_activation_bytes(cfg, vocab, end == 0, end == 1, *shape)
            if end == 1:  # multi-token prediction's depths sit with the head
                ends += cfg.mtp_depths * _mtp_depth_bytes(cfg, layout, shape, vocab)
            total += of_chunk * ends
            head = ends if end == 1 else head
    if cfg.recompute_granularity == "full":
        # backward reruns a group's forward while the in-flight inputs are held; the head of
        # that micro-batch has been freed by then
        group = cfg.recompute_num_layers if cfg.recompute_method == "uniform" else 1
        plain = replace(cfg, recompute_granularity=None, recompute_method=None)
        working = max(
            _chunk_activation_bytes(plain, layers[start : start + group], layout, shape)
            for layers in chunks
            for start in range(0, max(len(layers), 1), group)
        )
        total = max(total, total + working - head)
    return total


def rank_memory_bytes(
    cfg: ModelConfig, layout: Layout, pp_rank: int, mask_bytes: int = 2
) -> dict[str, float]:
    """{params, grads, optimizer, activations, total} of one rank of stage `pp_rank`."""
    out = rank_state_bytes(cfg, layout, pp_rank)
    out["activations"] = rank_activation_bytes(cfg, layout, pp_rank, mask_bytes)
    out["total"] = sum(out.values())
    return out
