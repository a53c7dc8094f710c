"""Which parameters each megatron-core rank holds, in the order its DistributedDataParallel lays
them into gradient buffers (the order of `named_parameters()`: a module's own parameters, then
its children's in registration order), for the distributed optimizer's saved buckets
(engine/interop/megatron/buckets.py).

Without expert parallelism there is one optimizer: its buffers (`dp_group_idx_<i>`, i = pp_rank
* TP + tp_rank) hold every parameter of the rank, routed experts included. With
--expert-model-parallel-size above 1 megatron-core chains two optimizers: `chained_0.` holds the
dense parameters of each tensor- and pipeline-parallel rank as above, `chained_1.` the routed
experts of each expert-model-parallel rank (i = etp_rank + ETP * ep_rank + ETP * EP * pp_rank),
that rank's local experts only.

In an MoE layer megatron-core registers the router (`weight`, then `bias` with
--add-bias-linear; the expert bias is a buffer, not a parameter), then the experts (each local
expert's fc1 and fc2 with SequentialMLP; with TransformerEngine's grouped GEMM, TEGroupedMLP,
fc1 then fc2 of all local experts), then the shared experts (their gate weight, a parameter of
the module itself, before fc1 and fc2). TransformerEngine keeps a separate norm before an MoE
layer (the router reads its output), where a dense layer's norm is fused into fc1. The
TransformerEngine orders are read from its source, not from checkpoints it wrote here (it has no
CPU build); as for every layout, each tensor read is checked against the saved weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.model import ModelConfig

_ATTN, _MLP = "self_attention", "mlp"
# (name for messages, stored key candidates (first present wins), split, expert or None)
_Spec = tuple[str, list[str], str, int | None]


@dataclass(frozen=True)
class MegatronParam:
    """One parameter of one megatron-core rank: the checkpoint's tensor it is part of (None
    for the tied output layer, which the checkpoint does not keep) and its index into that
    tensor's leading axes (layer, expert), how tensor parallelism splits it and this rank's
    place along that split, and its shape on the rank."""

    key: str | None
    index: tuple[int, ...]
    split: str  # "rows", "columns", "swiglu" (gate and up halves, rows) or "" (replicated)
    rank: int
    shape: tuple[int, ...]
    shared: bool = False  # an embedding weight shared across pipeline stages


def _norm(cfg: ModelConfig, name: str, fused_into: str | None) -> list[_Spec]:
    names = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
    keys = [f"decoder.layers.{fused_into}.layer_norm_{{p}}"] if fused_into else []
    keys.append(f"decoder.layers.{name}.{{p}}")
    return [(f"{name}.{p}", [k.format(p=p) for k in keys], "", None) for p in names]


def _linear(name: str, key: str, split: str, bias: bool, bias_split: str, expert=None):
    out = [(f"{name}.weight", [f"{key}.weight"], split, expert)]
    if bias:
        out.append((f"{name}.bias", [f"{key}.bias"], bias_split, expert))
    return out


def _mlp(cfg: ModelConfig, name: str, key: str, expert: int | None = None) -> list[_Spec]:
    fc1 = "swiglu" if cfg.gated_linear_unit else "rows"
    bias = cfg.add_bias_linear
    return _linear(f"{name}.linear_fc1", f"{key}.linear_fc1", fc1, bias, fc1, expert) + _linear(
        f"{name}.linear_fc2", f"{key}.linear_fc2", "columns", bias, "", expert
    )


def attention_specs(cfg: ModelConfig, fused_norms: bool) -> list[_Spec]:
    """A layer's norm and attention parameters in registration order."""
    qk_norms = []
    if cfg.qk_layernorm:
        for which in ("q_layernorm", "k_layernorm"):
            qk_norms += _norm(cfg, f"{_ATTN}.{which}", None)
    attn = f"decoder.layers.{_ATTN}"
    bias = cfg.add_bias_linear
    proj = _linear(f"{_ATTN}.linear_proj", f"{attn}.linear_proj", "columns", bias, "")
    qkv_bias = cfg.add_bias_linear or cfg.add_qkv_bias
    qkv = _linear(f"{_ATTN}.linear_qkv", f"{attn}.linear_qkv", "rows", qkv_bias, "rows")
    input_norm = _norm(cfg, "input_layernorm", f"{_ATTN}.linear_qkv")
    if fused_norms:  # TransformerEngine: LayerNormLinear registers its norm first
        return proj + input_norm + qkv + qk_norms
    return input_norm + proj + qkv + qk_norms


def dense_mlp_specs(cfg: ModelConfig) -> list[_Spec]:
    """A dense layer's norm and MLP parameters in registration order."""
    return _norm(cfg, "pre_mlp_layernorm", f"{_MLP}.linear_fc1") + _mlp(
        cfg, _MLP, f"decoder.layers.{_MLP}"
    )


def moe_specs(cfg: ModelConfig, experts: range | None, grouped: bool = False) -> list[_Spec]:
    """An MoE layer's norm and MLP parameters in registration order: with `experts`, the
    router, those routed experts and the shared experts; with None, the routed experts of
    every local expert kept in a separate optimizer are left out (see expert_specs)."""
    router = f"decoder.layers.{_MLP}.router"
    out = _norm(cfg, "pre_mlp_layernorm", f"{_MLP}.linear_fc1")
    out += _linear(f"{_MLP}.router", router, "", cfg.add_bias_linear, "")
    out += expert_specs(cfg, experts or range(0), grouped)
    if cfg.moe_shared_expert_intermediate_size:
        shared = f"decoder.layers.{_MLP}.shared_experts"
        if cfg.moe_shared_expert_gate:
            out.append((f"{_MLP}.shared_experts.gate_weight", [f"{shared}.gate_weight"], "", None))
        out += _mlp(cfg, f"{_MLP}.shared_experts", shared)
    return out


def expert_specs(cfg: ModelConfig, experts: range, grouped: bool = False) -> list[_Spec]:
    """The routed experts `experts` of one MoE layer in registration order (their stacked
    tensors carry the expert as an axis): expert by expert (SequentialMLP), or with
    TransformerEngine's grouped GEMM (TEGroupedMLP) fc1 then fc2, each the weights of every
    local expert, then their biases."""
    key = f"decoder.layers.{_MLP}.experts.experts"
    if not grouped:
        out = []
        for expert in experts:
            out += _mlp(cfg, f"{_MLP}.experts.local_experts.{expert}", key, expert)
        return out
    by_expert = [_mlp(cfg, f"{_MLP}.experts.local_experts.{e}", key, e) for e in experts]
    ordered = []
    for linear in ("linear_fc1", "linear_fc2"):
        for kind in ("weight", "bias"):
            suffix = f"{linear}.{kind}"
            ordered += [spec for specs in by_expert for spec in specs if spec[0].endswith(suffix)]
    return ordered


class MegatronRanks:
    """The parallel layout a checkpoint was saved with (from its saved arguments) and each
    rank's parameters, per optimizer (module doc)."""

    def __init__(self, source, cfg: ModelConfig, get, refuse):
        self.source, self.cfg, self.refuse = source, cfg, refuse
        self.tp = int(get("tensor_model_parallel_size") or 1)
        self.pp = int(get("pipeline_model_parallel_size") or 1)
        self.ep = int(get("expert_model_parallel_size") or 1) if cfg.is_moe else 1
        self.etp = int(get("expert_tensor_parallel_size") or self.tp) if cfg.is_moe else self.tp
        uneven = [
            name
            for name in (
                "virtual_pipeline_model_parallel_size",
                "num_layers_per_virtual_pipeline_stage",
                "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers",
                "pipeline_model_parallel_layout",
                "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split",
            )
            if get(name)
        ]
        if uneven:
            refuse(
                f"was saved with --{uneven[0].replace('_', '-')}; reading its layout is "
                "available for even pipeline stages without virtual stages only"
            )
        if self.ep == 1 and self.etp not in (1, self.tp):
            refuse(
                f"was saved with --expert-tensor-parallel-size {self.etp} under tensor "
                f"parallelism {self.tp} without expert parallelism, which is not read here"
            )
        self.fused_norms = (get("transformer_impl") or "transformer_engine") != "local"
        self.grouped = bool(get("moe_grouped_gemm")) and cfg.is_moe
        if self.grouped and (not self.fused_norms or get("moe_use_legacy_grouped_gemm")):
            refuse(
                "was saved with the legacy GroupedMLP experts (--moe-grouped-gemm without "
                "TransformerEngine, or --moe-use-legacy-grouped-gemm), whose buffers are not "
                "read here"
            )
        self.per_layer = any(k.startswith("decoder.layers.0.") for k in source.stored)
        self.pattern = cfg.moe_layer_pattern(cfg.num_layers)
        self.per_stage = cfg.num_layers // self.pp

    def optimizers(self) -> list[tuple[str, dict[int, list[MegatronParam]]]]:
        """(the state keys' prefix, {dp_group_idx: that rank's parameters in registration
        order}) of each of megatron-core's optimizers."""
        dense = {
            pp_rank * self.tp + tp_rank: self._dense_rank(tp_rank, pp_rank)
            for pp_rank in range(self.pp)
            for tp_rank in range(self.tp)
        }
        if self.ep == 1:
            return [("optimizer.distributed.", dense)]
        etp, ep = self.etp, self.ep
        experts = {
            etp_rank + etp * ep_rank + etp * ep * pp_rank: self._expert_rank(
                etp_rank, ep_rank, pp_rank
            )
            for pp_rank in range(self.pp)
            for ep_rank in range(ep)
            for etp_rank in range(etp)
        }
        return [
            ("chained_0.optimizer.distributed.", dense),
            ("chained_1.optimizer.distributed.", experts),
        ]

    def _param(self, spec: _Spec, layer: int | None, rank: int, size: int, shared=False):
        _, keys, split, expert = spec
        if layer is not None and self.per_layer:
            keys = [k.replace("decoder.layers.", f"decoder.layers.{layer}.", 1) for k in keys]
            index: tuple[int, ...] = ()
        else:
            index = () if layer is None else (layer,)
        if expert is not None:
            index += (expert,)
        key = next((k for k in keys if k in self.source.stored), None)
        if key is None:
            self.refuse(f"belongs to a model without {keys[0]}")
        shape = list(self.source.stored[key].size)[len(index) :]
        split = split if size > 1 else ""
        if split in ("rows", "swiglu"):
            shape[0] //= size
        elif split == "columns":
            shape[-1] //= size
        return MegatronParam(key, index, split, rank if split else 0, tuple(shape), shared)

    def _stage(self, pp_rank: int) -> range:
        return range(pp_rank * self.per_stage, (pp_rank + 1) * self.per_stage)

    def _dense_rank(self, tp_rank: int, pp_rank: int) -> list[MegatronParam]:
        """The parameters of one tensor- and pipeline-parallel rank in the dense optimizer
        (every parameter without expert parallelism)."""
        cfg, first, last = self.cfg, pp_rank == 0, pp_rank == self.pp - 1
        tied_across_stages = not cfg.untie_embeddings_and_output_weights and self.pp > 1
        embedding = ("embedding", ["embedding.word_embeddings.weight"], "rows", None)
        out = []
        if first:
            out.append(self._param(embedding, None, tp_rank, self.tp, tied_across_stages))
            if cfg.position_embedding_type == "learned_absolute":
                positions = ("positions", ["embedding.position_embeddings.weight"], "", None)
                out.append(self._param(positions, None, tp_rank, self.tp))
        attention = attention_specs(cfg, self.fused_norms)
        experts = range(cfg.num_experts or 0) if self.ep == 1 else None
        for layer in self._stage(pp_rank):
            moe = self.pattern[layer]
            mlp = moe_specs(cfg, experts, self.grouped) if moe else dense_mlp_specs(cfg)
            for spec in attention + mlp:
                # (routed experts without EP: split over ETP, which is 1 or TP)
                size = self.etp if spec[3] is not None else self.tp
                out.append(self._param(spec, layer, tp_rank, size))
        if last:
            norms = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
            for p in norms:
                spec = (p, [f"decoder.final_layernorm.{p}"], "", None)
                out.append(self._param(spec, None, tp_rank, self.tp))
            if cfg.untie_embeddings_and_output_weights:
                output = ("output", ["output_layer.weight"], "rows", None)
                out.append(self._param(output, None, tp_rank, self.tp))
            elif tied_across_stages:  # a copy of the word embeddings, not in the checkpoint
                copy = self._param(embedding, None, tp_rank, self.tp)
                out.append(MegatronParam(None, (), "rows", tp_rank, copy.shape, shared=True))
        return out

    def _expert_rank(self, etp_rank: int, ep_rank: int, pp_rank: int) -> list[MegatronParam]:
        """The routed experts one expert-model-parallel rank holds, in registration order."""
        local = self.cfg.num_experts // self.ep
        experts = range(ep_rank * local, (ep_rank + 1) * local)
        out = []
        for layer in self._stage(pp_rank):
            if self.pattern[layer]:
                for spec in expert_specs(self.cfg, experts, self.grouped):
                    out.append(self._param(spec, layer, etp_rank, self.etp))
        return out
