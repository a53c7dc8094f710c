"""The parts --log-grad-norms-interval breaks the gradient norm into: the embeddings, each
transformer layer (by global number, on whichever pipeline stage holds it), the final norm,
the output layer, each multi-token-prediction depth, and each optimizer parameter group (with
and without weight decay; at --decoupled-lr too when it is set; Muon's with --optimizer
muon). Each part's norm counts every element once under any TP/PP/DP/ZeRO layout, as the
global norm does, so their squares add up to its square (the layers' and the groups'
separately)."""

from __future__ import annotations

from engine.config.model import ModelConfig
from parallel.data_parallel.optimizer import NormParts

OPTIMIZER_GROUPS = (
    "weight decay",
    "no weight decay",
    "weight decay, decoupled lr",
    "no weight decay, decoupled lr",
)


def model_part_of(name: str) -> str:
    """'layers.3.mlp.linear_fc1.weight' -> 'layers.3'; 'embedding.word_...' -> 'embedding';
    'mtp.layers.0.eh_proj.weight' -> 'mtp.layers.0' (a multi-token-prediction depth)."""
    pieces = name.split(".")
    if pieces[0] == "mtp":
        return ".".join(pieces[:3])
    return ".".join(pieces[:2]) if pieces[0] == "layers" else pieces[0]


def grad_norm_parts(
    cfg: ModelConfig, chunks, decoupled_lr: bool = False, muon: bool = False
) -> NormParts:
    """The breakdown for a model's chunks (plain or DDP-wrapped) on this rank (`muon`: the
    optimizer's fifth group, Muon's weights, engine/optim/optimizer.py)."""
    model = ["embedding", *(f"layers.{i}" for i in range(cfg.num_layers)), "final_layernorm"]
    if cfg.untie_embeddings_and_output_weights:
        model.append("output_layer")
    model += [f"mtp.layers.{depth}" for depth in range(cfg.mtp_depths)]
    groups = dict(enumerate(OPTIMIZER_GROUPS if decoupled_lr else OPTIMIZER_GROUPS[:2]))
    if muon:
        groups[len(OPTIMIZER_GROUPS)] = "muon"
    labels = (*model, *(f"params: {g}" for g in groups.values()))
    group_index = {group: len(model) + i for i, group in enumerate(groups)}
    index = {label: i for i, label in enumerate(labels)}
    names = {}
    for chunk in chunks:
        module = chunk.module if hasattr(chunk, "module") else chunk
        for name, param in module.named_parameters():
            names[param] = getattr(param, "checkpoint_name", name)

    def labels_of(piece) -> tuple[int, ...]:
        part = model_part_of(names[piece.param])
        return index[part], group_index[piece.group]

    return NormParts(labels, labels_of)
