"""A training step's mixture-of-experts measurements, as Megatron-LM logs them: each
load-balancing and z loss (over its coefficient) averaged over the step's micro-batches and the
MoE layers, under megatron-core's names (`load_balancing_loss`, `seq_load_balancing_loss`,
`global_load_balancing_loss`, `z_loss`); and beside them each MoE layer's tokens per expert,
its load imbalance (the busiest expert's tokens over the mean) and, with a capacity, the
fraction of (token, expert) choices dropped.

Reductions: a rank's losses are its share over the ranks of its sequences (CP, and TP under
sequence parallelism): summed over those, averaged over data parallelism (as megatron-core's
tracker; global_load_balancing_loss, whose shares are over the data-parallel ranks too, is
summed), summed over pipeline stages (each holds its own layers). Token counts are summed over
every rank. Collective on every rank of an MoE model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config.model import ModelConfig
from engine.model.moe.router import routers_of
from engine.model.moe.stats import LOSS_NAMES
from parallel.comm import all_reduce


@dataclass(frozen=True)
class MoEStepMetrics:
    layers: list[int]  # the MoE layers' global numbers
    losses: dict[str, float]  # each chosen loss, mean over micro-batches and MoE layers
    layer_losses: dict[str, list[float]]  # the same per MoE layer (in layer order)
    tokens_per_expert: list[list[float]]  # per MoE layer
    dropped_fraction: float | None  # with a capacity: dropped choices / all choices

    @property
    def load_imbalance(self) -> list[float]:
        """Per MoE layer: the busiest expert's tokens over the mean (1.0: balanced)."""
        out = []
        for counts in self.tokens_per_expert:
            mean = sum(counts) / len(counts)
            out.append(max(counts) / mean if mean else 1.0)
        return out


def chosen_losses(cfg: ModelConfig) -> list[str]:
    """The names of the losses the config computes, in LOSS_NAMES order."""
    kinds = {
        "load_balancing_loss": cfg.aux_loss_coeff("aux_loss"),
        "seq_load_balancing_loss": cfg.aux_loss_coeff("seq_aux_loss"),
        "global_load_balancing_loss": cfg.aux_loss_coeff("global_aux_loss"),
        "z_loss": cfg.moe_z_loss_coeff or 0.0,
    }
    return [name for name in LOSS_NAMES if kinds[name]]


def step_metrics(chunks, cfg: ModelConfig, state, sequence_parallel: bool) -> MoEStepMetrics:
    """This step's measurements (module docstring), the same on every rank."""
    pattern = cfg.moe_layer_pattern(cfg.num_layers)
    moe_layers = [n for n, is_moe in enumerate(pattern) if is_moe]
    if pattern[-1]:  # multi-token prediction's layers, built as the last one
        moe_layers += list(range(cfg.num_layers, cfg.num_layers + cfg.mtp_depths))
    position = {layer: i for i, layer in enumerate(moe_layers)}
    experts, names = cfg.num_experts, LOSS_NAMES
    device = state.device
    losses = torch.zeros(len(moe_layers), len(names), dtype=torch.float64, device=device)
    counts = torch.zeros(len(moe_layers), experts, dtype=torch.float64, device=device)
    dropped = torch.zeros(2, dtype=torch.float64, device=device)  # dropped, all choices
    for router in routers_of(chunks):
        step = router.step_stats
        row = position[router.layer_number]
        if step.forwards:
            losses[row] = step.losses / step.forwards
        counts[row] = step.counts
        dropped += step.dropped
    sequence = [state.cp_group] + ([state.tp_group] if sequence_parallel else [])
    for group in sequence:
        all_reduce(losses, group)
    if state.dp_group is not None:
        all_reduce(losses, state.dp_group)
        averaged = [i for i, name in enumerate(names) if name != "global_load_balancing_loss"]
        losses[:, averaged] /= state.dp_size  # global_aux_loss: DP ranks' shares, summed
    all_reduce(losses, state.pp_group)
    tallies = torch.cat([counts.reshape(-1), dropped])  # one reduction for both
    for group in (state.tp_group if sequence_parallel else None, state.dp_cp_group, state.pp_group):
        all_reduce(tallies, group)
    counts, dropped = tallies[:-2].view_as(counts), tallies[-2:]
    chosen = chosen_losses(cfg)
    per_layer = {name: losses[:, names.index(name)].tolist() for name in chosen}
    lost, choices = dropped.tolist()
    fraction = lost / choices if cfg.moe_expert_capacity_factor and choices else None
    return MoEStepMetrics(
        layers=moe_layers,
        losses={name: sum(v) / len(v) for name, v in per_layer.items()},
        layer_losses=per_layer,
        tokens_per_expert=counts.tolist(),
        dropped_fraction=fraction,
    )


def expert_load(metrics: MoEStepMetrics) -> dict[str, list[float]]:
    """Per MoE layer ("<n>"), each expert's tokens over the mean (1.0: its even share), to 3
    decimals: the dashboard's heat map (JSONL only: not a scalar, TensorBoard skips it)."""
    out = {}
    for layer, counts in zip(metrics.layers, metrics.tokens_per_expert, strict=False):
        mean = sum(counts) / len(counts)
        out[str(layer)] = [round(c / mean, 3) if mean else 0.0 for c in counts]
    return out


def log_keys(found: list[MoEStepMetrics], per_layer: bool) -> dict:
    """A log window's record keys from its steps' measurements: each loss averaged over the
    steps (megatron-core's names), the latest step's largest load imbalance
    (`moe_load_imbalance`) and each expert's load (`moe_expert_load`, see expert_load) and
    the mean dropped fraction (`moe_dropped_fraction`); with
    `per_layer` (--moe-per-layer-logging), the latest step's `moe/<loss>_layer_<n>` (Megatron-LM's
    tags) and `moe/load_imbalance_layer_<n>` for each MoE layer n."""
    if not found:
        return {}
    last = found[-1]
    keys = {name: sum(m.losses[name] for m in found) / len(found) for name in last.losses}
    keys["moe_load_imbalance"] = max(last.load_imbalance)
    keys["moe_expert_load"] = expert_load(last)
    dropped = [m.dropped_fraction for m in found if m.dropped_fraction is not None]
    if dropped:
        keys["moe_dropped_fraction"] = sum(dropped) / len(dropped)
    if per_layer:
        for name, values in last.layer_losses.items():
            keys |= {f"moe/{name}_layer_{n}": v for n, v in zip(last.layers, values, strict=False)}
        imbalance = zip(last.layers, last.load_imbalance, strict=False)
        keys |= {f"moe/load_imbalance_layer_{n}": v for n, v in imbalance}
    return keys
