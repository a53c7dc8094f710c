"""megatron-core's mixture-of-experts tensors in a `torch_dist` checkpoint (its local and grouped
experts save alike), as our tensors of one MoE layer:

- `decoder.layers.mlp.router.weight` [L, E, h] (and `router.bias`, `router.expert_bias`);
- `decoder.layers.mlp.experts.experts.linear_fc1.weight` [L, E, 2f, h] (gate rows, then up),
  `...linear_fc2.weight` [L, E, h, f] (and their biases): the expert is the second axis;
- `decoder.layers.mlp.shared_experts.linear_fc1/linear_fc2.weight` and `...gate_weight`.

With dense layers among the MoE ones (Megatron-LM's --moe-layer-freq a list, or an integer above
1) megatron-core keys every tensor of every layer on its own, `decoder.layers.<i>.<name>`,
without the layer axis; engine/interop/megatron/layout.py reads either.
"""

from __future__ import annotations

from dataclasses import fields

from engine.config.model import ModelConfig
from engine.config.moe import MoEOptions

# (source key, part, expert index or None): where one of our tensors is
Source = tuple[str, str, int | None]


def moe_layer_sources(cfg: ModelConfig) -> dict[str, list[Source]]:
    """Our tensor (within an MoE layer) -> its megatron-core sources (layer-stacked names)."""
    mlp = "decoder.layers.mlp"
    out: dict[str, list[Source]] = {"mlp.router.weight": [(f"{mlp}.router.weight", "", None)]}
    if cfg.add_bias_linear:
        out["mlp.router.bias"] = [(f"{mlp}.router.bias", "", None)]
    if cfg.moe_router_enable_expert_bias:
        out["mlp.router.expert_bias"] = [(f"{mlp}.router.expert_bias", "", None)]
    for e in range(cfg.num_experts):
        ours, theirs = f"mlp.experts.local_experts.{e}", f"{mlp}.experts.experts"
        out |= _mlp(cfg, ours, theirs, e)
    if cfg.moe_shared_expert_intermediate_size:
        out |= _mlp(cfg, "mlp.shared_experts", f"{mlp}.shared_experts", None)
        if cfg.moe_shared_expert_gate:
            gate = f"{mlp}.shared_experts.gate_weight"
            out["mlp.shared_experts.gate_weight"] = [(gate, "", None)]
    return out


def _mlp(cfg: ModelConfig, ours: str, theirs: str, expert: int | None) -> dict[str, list[Source]]:
    out = {f"{ours}.linear_fc2.weight": [(f"{theirs}.linear_fc2.weight", "", expert)]}
    kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    for kind in kinds:
        if cfg.gated_linear_unit:
            for part in ("gate", "up"):
                out[f"{ours}.linear_fc1.{kind}.{part}"] = [
                    (f"{theirs}.linear_fc1.{kind}", part, expert)
                ]
        else:
            out[f"{ours}.linear_fc1.{kind}"] = [(f"{theirs}.linear_fc1.{kind}", "", expert)]
    if cfg.add_bias_linear:
        out[f"{ours}.linear_fc2.bias"] = [(f"{theirs}.linear_fc2.bias", "", expert)]
    return out


def moe_options_from_args(get) -> dict:
    """Our MoE fields from Megatron-LM's saved arguments (the same names; its list-valued
    flags saved as a single value become lists, --moe-layer-freq our string form)."""
    if not get("num_experts"):
        return {}
    out = {}
    for field in fields(MoEOptions):
        value = get(field.name)
        if value is None:
            continue
        if field.name == "moe_layer_freq":
            value = str(value)
        elif field.name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
            value = list(value) if isinstance(value, list | tuple) else [value]
        out[field.name] = value
    return out
