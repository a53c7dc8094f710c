"""Step time of a layout, predicted from a Machine's rates (engine/planning/hardware.py).

Per micro-batch, per layer, on one rank (T tokens of a CP rank, T_r between TP blocks):
- compute: the layer's four GEMMs at the machine's rate for their sizes (backward: two GEMMs
  of the same sizes each, so 3x the forward), core attention's model FLOPs at the attention
  rate, and the memory-bound ops' bytes (`layer_memory_bytes`; backward 2x) at the memory rate;
- recomputation: full reruns the layer's forward, selective reruns core attention's forward;
- TP: forward waits for its collectives (per block an all-reduce, or with SP an all-gather and
  a reduce-scatter); backward waits for the row-parallel output's gather (SP) and for what
  the column-parallel GEMMs do not hide of the input-gradient reduce and the input re-gather
  (parallel/tensor_parallel/linear_function.py overlaps them);
- CP: the ring passes key/value chunks C-1 times forward and key/value plus their gradients
  backward, hidden behind core attention as far as it lasts.
Per micro-batch on a stage: the embedding and the head (output GEMM, cross-entropy bytes) on the
first and last stage, adding each weight gradient into its fp32 buffer, and the pipeline
transfers (1F1B sends and receives block). An MoE layer: its shared experts as the MLP, its
routed experts, dispatch and all-to-all (`a2a_comm`) from engine/planning/moe_terms.py. The
step: (m + (p - 1) / v) x the slowest stage's time per micro-batch (the schedule's bubble), then
the data-parallel collectives the engine's overlap does not hide (gradients in fp32, parameters
gathered in the activation dtype; with optim_grads(_params) every micro-batch), and the
optimizer's pass over its shard; with Muon its Newton-Schulz work and collectives
(engine/planning/muon_terms.py).

Collectives are rings: an all-reduce of B bytes over n ranks takes 2(n-1) latencies and moves
2(n-1)/n B; an all-gather or reduce-scatter half of that. A group uses the intra-node link when
its ranks fit in a node (TP innermost, then CP, DP, PP, as parallel/state.py orders them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config.model import ModelConfig
from engine.monitor.metrics import model_flops_per_token
from engine.planning.hardware import Machine
from engine.planning.memory import (
    Layout,
    chunk_layer_counts,
    rank_parameter_groups,
    rank_parameters,
    stage_moe_layers,
    stage_shape,
)
from engine.planning.moe_terms import moe_mlp_seconds
from engine.planning.muon_terms import muon_step_s

GRAD_BYTES = 4  # fp32 main gradients, reduced in fp32 (Megatron-LM's default under bf16)
ADAM_BYTES_PER_PARAM = 42  # grad read, fp32 master and both moments read + written, param written,
# and the clipping's norm and scale passes over the gradient


def collective_s(kind: str, nbytes: float, n: int, stride: int, machine: Machine) -> float:
    """Seconds of a ring all-reduce, all-gather or reduce-scatter ("all_reduce" or "gather";
    `nbytes` the full tensor) over `n` ranks `stride` ranks apart. A group with k members per
    node runs hierarchically: a ring inside each node over the intra-node link, and between
    nodes each member carries 1/k of the data over its own link (as NCCL's rings do)."""
    if n == 1:
        return 0.0
    per_node = 1  # members of the group on one node: a divisor of n that fits in a node
    if stride < machine.gpus_per_node:
        per_node = math.gcd(n, max(1, machine.gpus_per_node // stride))
    nodes = n // per_node
    rounds = 2 if kind == "all_reduce" else 1
    seconds = 0.0
    if per_node > 1:
        k, link = per_node, machine.intra
        seconds += rounds * ((k - 1) * link.latency_s + (k - 1) / k * nbytes / link.bytes_per_s)
    if nodes > 1:
        link, part = machine.inter, nbytes / per_node
        seconds += rounds * (
            (nodes - 1) * link.latency_s + (nodes - 1) / nodes * part / link.bytes_per_s
        )
    return seconds


def layer_memory_bytes(
    cfg: ModelConfig, tokens: int, between: int, tp: int, a: int, ffn: int | None = None
) -> float:
    """Bytes the memory-bound ops of one layer read and write in forward: two norms (RMSNorm
    computes in fp32), two residual adds, dropout with its mask, RoPE on queries and keys,
    the attention layout copies, and the MLP's activation (of width `ffn`, default the dense
    MLP's)."""
    h, d = cfg.hidden_size, cfg.head_dim
    f = (cfg.ffn_size if ffn is None else ffn) // tp
    n, g = cfg.num_attention_heads // tp, cfg.query_groups // tp
    norm = 2 * a + (8 if cfg.normalization == "RMSNorm" else 0)
    total = 2 * norm * between * h + 2 * 3 * a * between * h
    if cfg.hidden_dropout:
        total += 2 * (2 * a + a) * between * h
    if cfg.position_embedding_type == "rope":
        total += 3 * 2 * a * tokens * (n + g) * d
    total += 2 * a * tokens * (n + 2 * g) * d + 2 * a * tokens * n * d
    total += (5 if cfg.gated_linear_unit else 2) * a * tokens * f
    return total


@dataclass
class _Shape:
    tokens: int  # per micro-batch on a CP rank
    between: int  # held between TP blocks
    a: int


def _layer_parts(
    cfg: ModelConfig, layout: Layout, machine: Machine, shape: _Shape, moe: bool = False
) -> dict:
    """Seconds of one layer for one micro-batch, forward + backward, by part; an MoE layer's
    (`moe`) with its shared experts as the TP-split MLP and its routed experts and dispatch
    from engine/planning/moe_terms.py."""
    h, d, tp = cfg.hidden_size, cfg.head_dim, layout.tp
    ffn = (cfg.moe_shared_expert_intermediate_size or 0) if moe else cfg.ffn_size
    n, g, f = cfg.num_attention_heads // tp, cfg.query_groups // tp, ffn // tp
    T, a = shape.tokens, shape.a
    fc1 = f * (2 if cfg.gated_linear_unit else 1)
    qkv = machine.gemm_seconds(T, (n + 2 * g) * d, h)
    out_proj = machine.gemm_seconds(T, h, n * d)
    attention_flops = 4 * T * cfg.seq_length * n * d  # a CP rank's queries against all keys
    if cfg.multi_latent_attention:  # down projections on T_r rows whole, the rest split
        *inputs, (width, _, _) = cfg.latent_projections()
        qkv = sum(
            machine.gemm_seconds(T, o // tp, i)
            if split
            else machine.gemm_seconds(shape.between, o, i)
            for i, o, split in inputs
        )
        out_proj = machine.gemm_seconds(T, h, width // tp)
        widths = cfg.latent_query_head_dim + cfg.v_head_dim
        attention_flops = 2 * T * cfg.seq_length * n * widths
    fc1_s = machine.gemm_seconds(T, fc1, h) if f else 0.0
    column = qkv + fc1_s
    row = out_proj + (machine.gemm_seconds(T, h, f) if f else 0.0)
    attention = 3 * attention_flops / machine.attention_flops
    memory = layer_memory_bytes(cfg, T, shape.between, tp, a, ffn)
    memory = 3 * memory / machine.memory_bytes_per_s
    parts = {"gemm": 3 * (column + row), "attention": attention, "memory": memory}
    forward = column + row + attention / 3 + memory / 3
    if moe:
        routed = moe_mlp_seconds(cfg, layout, machine, shape.between)
        for part, seconds in routed.items():
            parts[part] = parts.get(part, 0.0) + seconds
        forward += routed["gemm"] / 3 + routed["memory"] / 3 + routed["a2a_comm"] / 2
    # TP, per block (attention, MLP): the column input and the row output
    full = T * h * a
    # in backward, each block's column-parallel GEMMs (its input gradient, its weight
    # gradient: each as long as the forward GEMM) hide that block's input-side collectives
    hides = (qkv, fc1_s) if machine.overlaps_comm else (0.0, 0.0)
    hides = hides if f else hides[:1]  # (an MoE layer without shared experts: attention only)
    blocks = len(hides)
    if layout.sequence_parallel and tp > 1:
        gather = collective_s("gather", full, tp, 1, machine)
        forward_comm = blocks * 2 * gather
        backward_comm = blocks * gather  # the row output's gradient gathered
        backward_comm += sum(2 * max(0.0, gather - hide) for hide in hides)  # re-gather, reduce
    else:
        reduce = collective_s("all_reduce", full, tp, 1, machine)
        forward_comm = blocks * reduce
        backward_comm = sum(max(0.0, reduce - hide) for hide in hides)
    if layout.tp_comm_overlap:  # Megatron-LM's --tp-comm-overlap: chunks hidden behind GEMMs
        forward_comm = max(0.0, forward_comm - (column + row))
        backward_comm = max(0.0, backward_comm - 2 * (column + row))
    parts["tp_comm"] = forward_comm + backward_comm
    # CP ring: key and value chunks (and their gradients backward), hidden behind attention
    cp = layout.cp
    if cp > 1:
        kv = 2 * T * g * d * a
        if cfg.multi_latent_attention:  # every head's keys and values, padded to one width
            kv = 2 * T * n * max(cfg.latent_query_head_dim, cfg.v_head_dim) * a
        ring = machine.link(tp * cp)
        passes = (cp - 1) * ring.seconds(kv) + 2 * (cp - 1) * ring.seconds(kv)
        parts["cp_comm"] = max(0.0, passes - (attention if machine.overlaps_comm else 0.0))
    recompute = cfg.recompute_granularity
    if recompute == "full":
        parts["recompute"] = forward + forward_comm
    elif recompute == "selective":
        parts["recompute"] = attention / 3
    return parts


def _stage_parts(cfg: ModelConfig, layout: Layout, machine: Machine, pp_rank: int) -> dict:
    """Seconds of stage `pp_rank` per micro-batch (all its chunks), by part."""
    a, tp, h = machine.activation_bytes, layout.tp, cfg.hidden_size
    tokens = cfg.seq_length // layout.cp * layout.micro_batch_size
    between = tokens // tp if layout.sequence_parallel and tp > 1 else tokens
    shape = _Shape(tokens, between, a)
    layers = sum(chunk_layer_counts(cfg, layout, pp_rank))
    moe = stage_moe_layers(cfg, layout, pp_rank)
    parts = {k: v * (layers - moe) for k, v in _layer_parts(cfg, layout, machine, shape).items()}
    if moe:
        for k, v in _layer_parts(cfg, layout, machine, shape, moe=True).items():
            parts[k] = parts.get(k, 0.0) + v * moe
    vocab = cfg.padded_vocab_size(tp) // tp
    if pp_rank == 0:  # the embedding's gather, and its gradient added into fp32
        parts["memory"] += tokens * h * (2 * a + 8) / machine.memory_bytes_per_s
    if pp_rank == layout.pp - 1:  # the output GEMMs, the final norm, the cross-entropy
        parts["gemm"] += 3 * machine.gemm_seconds(tokens, vocab, h)
        head = tokens * vocab * (3 * a + 28) + 3 * tokens * h * (2 * a + 8)
        parts["memory"] += head / machine.memory_bytes_per_s
        if tp > 1:
            parts["tp_comm"] += 2 * collective_s("gather", tokens * h * a, tp, 1, machine)
        depths = cfg.mtp_depths  # each a layer built as the last, its projection and a head
        if depths:
            moe_last = bool(cfg.moe_layer_pattern(cfg.num_layers)[-1])
            for k, v in _layer_parts(cfg, layout, machine, shape, moe=moe_last).items():
                parts[k] = parts.get(k, 0.0) + depths * v
            projection = machine.gemm_seconds(tokens, h // tp, 2 * h)
            parts["gemm"] += depths * 3 * (machine.gemm_seconds(tokens, vocab, h) + projection)
            parts["memory"] += depths * head / machine.memory_bytes_per_s
    if not layout.fp32_wgrad_gemm:
        held = rank_parameters(cfg, layout, pp_rank)
        parts["grad_accumulation"] = held * (a + 2 * GRAD_BYTES) / machine.memory_bytes_per_s
    if layout.pp > 1:
        span = layout.tp * layout.cp * layout.dp * 2
        transfer = machine.link(span).seconds(between * h * a)
        parts["pp_comm"] = 2 * transfer * layout.virtual
    return parts


def _data_parallel_s(
    layout: Layout,
    machine: Machine,
    params: int,
    forward: float,
    backward: float,
    group: tuple[int, int] | None = None,
):
    """Exposed seconds of the data-parallel collectives of a step (gradients of the params a
    rank holds, parameters gathered), given one micro-batch's forward and backward time;
    `group`: (size, stride) of the group they are reduced over, default DP x CP, TP apart
    (gradients are reduced over the CP ranks too)."""
    m = layout.num_microbatches
    dp, stride = group or (layout.dp * layout.cp, layout.tp)
    if dp == 1 or params == 0:
        return 0.0
    grads, weights = params * GRAD_BYTES, params * machine.activation_bytes
    if not machine.overlaps_comm:
        forward = backward = 0.0
    hide_reduce = backward if layout.overlap_grad_reduce else 0.0
    if layout.strategy == "no_shard":
        return max(0.0, collective_s("all_reduce", grads, dp, stride, machine) - hide_reduce)
    reduce = collective_s("gather", grads, dp, stride, machine)
    gather = collective_s("gather", weights, dp, stride, machine)
    if layout.strategy == "optim":
        hide_gather = forward if layout.overlap_param_gather else 0.0
        return max(0.0, reduce - hide_reduce) + max(0.0, gather - hide_gather)
    per_microbatch = max(0.0, reduce - hide_reduce)
    if layout.strategy == "optim_grads":
        hide_gather = forward if layout.overlap_param_gather else 0.0
        return m * per_microbatch + max(0.0, gather - hide_gather)
    # optim_grads_params: gathered ahead of every forward and backward (prefetched)
    return m * (per_microbatch + max(0.0, gather - forward) + max(0.0, gather - backward))


def predict_step(cfg: ModelConfig, layout: Layout, machine: Machine) -> dict:
    """{parts: seconds per step by part (the slowest stage), step_s, tokens_per_s, tflops
    (model TFLOP/s per device), mfu (None without a peak)}."""
    stages = [0, layout.pp - 1] if layout.pp > 1 else [0]
    per_stage = {r: _stage_parts(cfg, layout, machine, r) for r in stages}
    slowest = max(stages, key=lambda r: sum(per_stage[r].values()))
    stage = per_stage[slowest]
    t_mb = sum(stage.values())
    m, p, v = layout.num_microbatches, layout.pp, layout.virtual
    parts = {k: val * m for k, val in stage.items()}
    parts["bubble"] = (p - 1) / v * t_mb
    params, experts = rank_parameter_groups(cfg, layout, slowest)
    compute = stage["gemm"] + stage["attention"] + stage["memory"]
    forward, backward = compute / 3, 2 * compute / 3
    dense = _data_parallel_s(layout, machine, params, forward, backward)
    parts["dp_comm"] = dense
    if experts:  # over their own group, hidden behind what the dense collectives leave
        hidden = _data_parallel_s(layout, machine, params, 0.0, 0.0) - dense
        left = max(0.0, 1.0 - hidden / (forward + backward)) if forward + backward else 0.0
        group = (layout.expert_dp, layout.expert_tp * layout.ep)  # megatron-core's folding
        parts["dp_comm"] += _data_parallel_s(
            layout, machine, experts, forward * left, backward * left, group
        )
    local = params + experts
    if layout.strategy != "no_shard":
        local = params / (layout.dp * layout.cp) + experts / layout.expert_dp
    parts["optimizer"] = local * ADAM_BYTES_PER_PARAM / machine.memory_bytes_per_s
    if layout.optimizer == "muon":

        def gather_s(nbytes: float, n: int, stride: int) -> float:
            return collective_s("gather", nbytes, n, stride, machine)

        def all_reduce_s(nbytes: float, n: int, stride: int) -> float:
            return collective_s("all_reduce", nbytes, n, stride, machine)

        stage = stage_shape(cfg, layout, slowest)
        parts["newton_schulz"] = muon_step_s(cfg, layout, machine, stage, gather_s, all_reduce_s)
    overheads = machine.overheads
    if overheads:  # calibrated: "step", "per_microbatch", "per_microbatch_layer"
        layers = max(sum(chunk_layer_counts(cfg, layout, r)) for r in stages)
        parts["overhead"] = overheads["step"] + (m + (p - 1) / v) * (
            overheads["per_microbatch"] + layers * overheads["per_microbatch_layer"]
        )
    step = sum(parts.values())
    tokens = cfg.seq_length * layout.micro_batch_size * m * layout.dp
    tflops = tokens * model_flops_per_token(cfg, cfg.padded_vocab_size(layout.tp)) / step
    tflops /= layout.world * 1e12
    peak = machine.peak_flops
    return {
        "parts": parts,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "tflops": tflops,
        "mfu": tflops * 1e12 / peak if peak else None,
    }
