"""The planner's mixture-of-experts terms: what an MoE layer (engine/model/moe/) holds and costs
on one rank, beside engine/planning/memory.py's and step_time.py's dense ones.

Parameters. An MoE layer keeps the dense layer's norms and attention; in place of the MLP it
holds the router (E x h, whole on every rank, and E biases with --add-bias-linear), the shared
experts when there are any (an MLP of --moe-shared-expert-intermediate-size split over TP like
the dense one, and with --moe-shared-expert-gate an h-wide gate weight), and E / EP routed
experts, each an MLP of --moe-ffn-hidden-size split over the expert tensor-parallel size
(ETP). The routed experts are the "expert" parameters: their gradients and optimizer state
are reduced and sharded over the expert data-parallel group, TP x CP x DP / (ETP x EP) ranks
(megatron-core's folding, parallel/expert_parallel/groups.py), the rest over DP x CP.

Activations, per MoE layer and micro-batch, with R tokens on a rank (T / TP under sequence
parallelism, which MoE under TP requires) and k the router's top-k, the routing assumed balanced
(each rank's experts receive R k x ETP rows: its share of every expert-parallel rank's rows,
gathered over ETP): the router's fp32 logits and scores (4 x 4 R E bytes), the rows' token and
order indices (3 x 8 R k), the grouped rows each expert keeps as its input (a R k ETP h) and
what its MLP keeps (as the dense MLP, on R k ETP rows and f / ETP; its router probability
scaling keeps the scaled activation, a R k ETP f / ETP, and the fp32 probabilities), the
experts' outputs on their way back, each step keeping its input (the un-permute's index_add, and
the index_copy regrouping them before the expert tensor-parallel sum and the expert-parallel
return: a h (R k ETP + R k [ETP > 1] + R k [EP > 1])), and the shared experts' MLP on the
layer's tokens (with the gate, the shared output and the gate's sigmoid, which their product
keeps).

Step time, per MoE layer and micro-batch: the expert GEMMs on R k ETP rows (3x the forward
for forward + backward), the router's GEMM, the shared experts' as a dense MLP's, the
dispatch's memory-bound copies (permute, regroup, unpermute: a R k h each way, read and
written), and the all-to-all: the rows out and the outputs back in forward, their gradients in
backward (4 exchanges of a R k h (EP - 1) / EP per rank over EP ranks, ETP apart), and with
ETP above 1 the rows' gather to the expert tensor-parallel group and the outputs' sum back
(4 exchanges of a R k h (ETP - 1)), none hidden.
"""

from __future__ import annotations

from engine.config.model import ModelConfig


def _mlp_parameters(cfg: ModelConfig, hidden: int, ffn: int, split: int) -> int:
    """One MLP of width `ffn` split over `split` ranks (biases of the first projection split,
    the second's whole)."""
    fc1 = ffn * (2 if cfg.gated_linear_unit else 1)
    count = hidden * fc1 // split + ffn // split * hidden
    if cfg.add_bias_linear:
        count += fc1 // split + hidden
    return count


def moe_mlp_dense_parameters(cfg: ModelConfig, tp: int) -> int:
    """The router and shared experts of one MoE layer on one TP rank."""
    h = cfg.hidden_size
    count = cfg.num_experts * h + (cfg.num_experts if cfg.add_bias_linear else 0)
    shared = cfg.moe_shared_expert_intermediate_size
    if shared:
        count += _mlp_parameters(cfg, h, shared, tp)
        count += h if cfg.moe_shared_expert_gate else 0
    return count


def dense_mlp_parameters(cfg: ModelConfig, tp: int) -> int:
    """The dense MLP of one layer on one TP rank."""
    return _mlp_parameters(cfg, cfg.hidden_size, cfg.ffn_size, tp)


def routed_expert_parameters(cfg: ModelConfig, ep: int, etp: int) -> int:
    """The routed experts one rank holds of one MoE layer."""
    per_expert = _mlp_parameters(cfg, cfg.hidden_size, cfg.expert_ffn_size, etp)
    return cfg.num_experts // ep * per_expert


def _mlp_activation_bytes(cfg: ModelConfig, rows: int, ffn: int, a: int) -> int:
    """What an MLP of width `ffn` (one rank's share) keeps beyond its input (the dense
    layer's terms: GELU its input and output, SwiGLU the fused projection, SiLU and product)."""
    return a * rows * ffn * (4 if cfg.gated_linear_unit else 2)


def moe_mlp_activation_bytes(
    cfg: ModelConfig, tp: int, ep: int, etp: int, rows: int, a: int, tokens: int
):
    """Bytes one MoE layer's MLP part keeps for backward beyond the dense layer's norms and
    attention (module doc); `rows` the tokens on this rank (R), `tokens` the micro-batch's
    tokens on a CP rank (what the shared experts' gathered input holds under SP)."""
    h, k, e = cfg.hidden_size, cfg.moe_router_topk, cfg.num_experts
    total = 4 * 4 * rows * e  # the router's logits, scores, probabilities and map
    pairs = rows * k
    total += 3 * 8 * pairs  # token index, exchange order, the gathered rows' order
    received = pairs * etp
    f = cfg.expert_ffn_size // etp
    total += a * received * h  # the experts' inputs
    total += _mlp_activation_bytes(cfg, received, f, a)
    total += a * received * f + 4 * received  # the probability-scaled activation, probs
    # the experts' outputs on their way back, each step keeping its input: the un-permute's
    # index_add, and the index_copy that regroups them for the expert tensor-parallel sum
    # and for the expert-parallel return
    total += a * h * (received + (pairs if etp > 1 else 0) + (pairs if ep > 1 else 0))
    shared = cfg.moe_shared_expert_intermediate_size
    if shared:  # an MLP split over TP as the dense one: on the gathered sequence under SP
        total += _mlp_activation_bytes(cfg, tokens, shared // tp, a)
        if cfg.moe_shared_expert_gate:  # the shared output and its gate, kept by their
            total += a * rows * h + 2 * a * rows  # product (after the reduce-scatter: rows)
    return total


def dense_mlp_activation_bytes(cfg: ModelConfig, tp: int, tokens: int, a: int) -> int:
    """The dense MLP's share of layer_activation_bytes (engine/planning/activations.py)."""
    return _mlp_activation_bytes(cfg, tokens, cfg.ffn_size // tp, a)


def all_to_all_s(nbytes: float, n: int, stride: int, machine) -> float:
    """Seconds of an all-to-all in which each of `n` ranks (`stride` apart) holds `nbytes`
    and keeps 1/n of them: (n - 1) latencies and (n - 1)/n of the bytes over the link."""
    if n == 1:
        return 0.0
    link = machine.link(stride * n)
    return (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bytes_per_s


def moe_mlp_seconds(cfg: ModelConfig, layout, machine, rows: int) -> dict[str, float]:
    """Seconds of one MoE layer's MLP part for one micro-batch, forward + backward, by part
    (module doc); `rows` the tokens on this rank."""
    a, h, k = machine.activation_bytes, cfg.hidden_size, cfg.moe_router_topk
    ep, etp = layout.ep, layout.expert_tp
    received = rows * k * etp
    f = cfg.expert_ffn_size // etp
    fc1 = f * (2 if cfg.gated_linear_unit else 1)
    experts = cfg.num_experts // ep
    per_expert = max(1, received // experts)
    gemm = machine.gemm_seconds(per_expert, fc1, h) + machine.gemm_seconds(per_expert, h, f)
    gemm *= experts
    gemm += machine.gemm_seconds(rows, cfg.num_experts, h)  # the router
    memory = 3 * (2 * 3 * a * rows * k * h + (5 if cfg.gated_linear_unit else 2) * a * received * f)
    parts = {"gemm": 3 * gemm, "memory": memory / machine.memory_bytes_per_s}
    exchange = a * rows * k * h
    parts["a2a_comm"] = 4 * all_to_all_s(exchange, ep, etp, machine)
    parts["a2a_comm"] += 4 * all_to_all_s(exchange * etp, etp, 1, machine)
    return parts
