"""The planner's Muon terms (--optimizer muon): what Muon changes in a rank's memory and step,
beside engine/planning/memory.py's and step_time.py's Adam.

Which weights Muon trains (engine/optim/muon_with_adam.py): the 2-D ones but the word
embeddings and the output layer. Per dense layer the fused QKV, as its Q, K and V matrices
(unless --muon-no-split-qkv), the output projection and the MLP's two projections (SwiGLU's
gate and up one matrix); with multi-latent attention each projection; an MoE layer's router,
shared experts (and their gate) and each routed expert's two projections; a learned position
embedding on the first stage; the multi-token-prediction depths' projections and layers on
the last. Column-parallel weights are split by rows over TP, row-parallel ones by columns;
the routed experts over the expert TP size and sharded over the expert data-parallel group.

Memory: Muon's state per weight is its fp32 master and its fp32 momentum, 8 bytes per
parameter where Adam holds 12 (master and two moments), sharded over DP like Adam's by the
distributed optimizer and the sharding strategies (engine/optim/muon_sharded.py).

Step time: Newton-Schulz of an r x c matrix, m = min(r, c), n = max(r, c), is per iteration
three GEMMs, X X^T ([m, n] by [n, m]), A A ([m, m] by [m, m]) and B X ([m, m] by [m, n]), at
the machine's GEMM rate, --muon-num-ns-steps iterations (5). A rank orthogonalises its TP
shards under --muon-tp-mode blockwise, the whole matrices under duplicated (every TP rank the
same, after an all-gather of their fp32 momentum over TP), its shards under distributed with
m the unsharded dimension (plus an all-reduce of the m x m Gram matrix per iteration, in the
iterations' precision); with the state sharded over DP, 1/DP
of them (the owners' balanced split, in the ideal), after an all-gather and before a
reduce-scatter of the Muon weights' fp32 updates over DP. None of it overlaps other work.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.model import ModelConfig

MUON_STATE_BYTES = 8  # fp32 master + fp32 momentum per parameter
NS_STEPS = 5


def layer_matrices(
    cfg: ModelConfig, tp: int, whole: bool, moe: bool = False, split_qkv: bool = True
) -> list:
    """(rows, cols, the dimension TP splits or None) of the matrices Muon orthogonalises for
    one layer: each TP rank's shard (`whole` False) or the whole matrix (`whole`); an MoE
    layer's (`moe`) router and shared experts in place of the MLP (its routed experts:
    expert_matrices)."""
    split = 1 if whole else tp
    h, n, g, d = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    out = []
    if cfg.multi_latent_attention:
        projections = cfg.latent_projections()
        for index, (inputs, outputs, tp_split) in enumerate(projections):
            by = split if tp_split else 1
            if index == len(projections) - 1:  # the output projection: row-parallel
                out.append((outputs, inputs // by, 1 if tp_split else None))
            else:
                out.append((outputs // by, inputs, 0 if tp_split else None))
    else:
        parts = [n * d, g * d, g * d] if split_qkv else [(n + 2 * g) * d]
        out += [(rows // split, h, 0) for rows in parts]
        out.append((h, n * d // split, 1))
    if not moe:
        return out + _mlp_matrices(cfg, cfg.ffn_size, split)
    out.append((cfg.num_experts, h, None))  # the router
    if cfg.moe_shared_expert_intermediate_size:
        out += _mlp_matrices(cfg, cfg.moe_shared_expert_intermediate_size, split)
        if cfg.moe_shared_expert_gate:
            out.append((1, h, None))
    return out


def _mlp_matrices(cfg: ModelConfig, ffn: int, split: int) -> list:
    fc1 = ffn * (2 if cfg.gated_linear_unit else 1)
    return [(fc1 // split, cfg.hidden_size, 0), (cfg.hidden_size, ffn // split, 1)]


def expert_matrices(cfg: ModelConfig, moe_layers: int, ep: int, etp: int, whole: bool) -> list:
    """The routed experts' matrices one rank holds: each expert's two projections."""
    if not moe_layers:
        return []
    per_expert = _mlp_matrices(cfg, cfg.expert_ffn_size, 1 if whole else etp)
    return moe_layers * (cfg.num_experts // ep) * per_expert


def stage_matrices(cfg: ModelConfig, stage, tp: int, whole: bool) -> list:
    """The dense matrices of a pipeline stage (`stage`: a StageShape): its layers, a learned
    position embedding on the first stage, the multi-token-prediction depths on the last."""
    dense = stage.layers - stage.moe_layers
    out = dense * layer_matrices(cfg, tp, whole)
    out += stage.moe_layers * layer_matrices(cfg, tp, whole, moe=True)
    if stage.first and cfg.position_embedding_type == "learned_absolute":
        out.append((cfg.max_positions, cfg.hidden_size, None))
    if stage.last and cfg.mtp_depths:
        moe_last = cfg.moe_layer_pattern(cfg.num_layers)[-1]
        per_depth = [(cfg.hidden_size // (1 if whole else tp), 2 * cfg.hidden_size, 0)]
        out += cfg.mtp_depths * (per_depth + layer_matrices(cfg, tp, whole, moe=bool(moe_last)))
    return out


@dataclass(frozen=True)
class StageShape:
    """What of the model a pipeline stage holds: its layers (`moe_layers` of them MoE),
    whether it is the first and the last stage, and the routed experts' split (EP, ETP)."""

    layers: int
    moe_layers: int = 0
    first: bool = True
    last: bool = True
    ep: int = 1
    etp: int = 1

    def expert_layers(self, cfg: ModelConfig) -> int:
        """MoE layers whose routed experts the stage holds (its own, and the MTP depths')."""
        extra = cfg.mtp_depths if self.last and cfg.mtp_depths else 0
        moe_last = cfg.is_moe and cfg.moe_layer_pattern(cfg.num_layers)[-1]
        return self.moe_layers + (extra if moe_last else 0)


def muon_parameters(cfg: ModelConfig, stage: StageShape, tp: int) -> tuple[int, int]:
    """(dense, routed experts') parameters one rank of the stage trains with Muon (shards)."""
    dense = sum(r * c for r, c, _ in stage_matrices(cfg, stage, tp, whole=False))
    experts = expert_matrices(cfg, stage.expert_layers(cfg), stage.ep, stage.etp, whole=False)
    return dense, sum(r * c for r, c, _ in experts)


def newton_schulz_s(m: int, n: int, machine, steps: int = NS_STEPS) -> float:
    """Seconds of Newton-Schulz on an m x n matrix X, Gram matrix X X^T m x m (module
    docstring: m the smaller dimension, or under --muon-tp-mode distributed the unsharded)."""
    per_step = (
        machine.gemm_seconds(m, m, n)
        + machine.gemm_seconds(m, m, m)
        + machine.gemm_seconds(m, n, m)
    )
    return steps * per_step


def muon_step_s(cfg: ModelConfig, layout, machine, stage: StageShape, gather_s, all_reduce_s):
    """Seconds Muon's orthogonalisation adds to one rank's step (module docstring); `gather_s(
    bytes, ranks, stride)`: an all-gather's (or reduce-scatter's) seconds, `all_reduce_s` an
    all-reduce's."""
    tp, mode = layout.tp, layout.muon_tp_mode
    dense, experts = muon_parameters(cfg, stage, tp)
    seconds = _matrices_s(stage_matrices(cfg, stage, tp, mode == "duplicated"), tp, mode,
                          machine, all_reduce_s)  # fmt: skip
    if mode == "duplicated" and tp > 1:
        seconds += gather_s(4 * dense * tp, tp, 1)
    dp = layout.dp * layout.cp
    if layout.strategy != "no_shard" and dp > 1:
        seconds = seconds / dp + 2 * gather_s(4 * dense, dp, tp)
    if experts:
        etp, edp = stage.etp, layout.expert_dp
        whole = mode == "duplicated"
        matrices = expert_matrices(cfg, stage.expert_layers(cfg), stage.ep, etp, whole)
        part = _matrices_s(matrices, etp, mode, machine, all_reduce_s)
        if whole and etp > 1:
            part += gather_s(4 * experts * etp, etp, 1)
        if layout.strategy != "no_shard" and edp > 1:
            part = part / edp + 2 * gather_s(4 * experts, edp, etp * stage.ep)
        seconds += part
    return seconds


def _matrices_s(matrices: list, tp: int, mode: str, machine, all_reduce_s) -> float:
    """Newton-Schulz seconds of these matrices (their TP size and mode: module docstring)."""
    seconds = 0.0
    for rows, cols, dim in matrices:
        if mode == "distributed" and tp > 1 and dim is not None:  # Gram over the whole dim
            m, n = (cols, rows) if dim == 0 else (rows, cols)
            grams = NS_STEPS * all_reduce_s(machine.activation_bytes * m * m, tp, 1)
            seconds += newton_schulz_s(m, n, machine) + grams
        else:
            seconds += newton_schulz_s(min(rows, cols), max(rows, cols), machine)
    return seconds
