"""--optimizer muon: Muon (engine/optim/muon.py) for the 2-D hidden weights and AdamW for the
rest, as one torch optimizer (megatron-core chains two), so that the mixed-precision wrapper
(parallel/data_parallel/optimizer.py), the learning-rate and weight-decay schedules and the
checkpoints see one set of groups and one state (Muon's `momentum_buffer`, Adam's moments).

Which parameters get Muon, as megatron-core 0.16.1 decides: the 2-D ones but the word
embeddings and the output layer (so the attention and MLP weights, a MoE router's and a
learned position embedding too); AdamW the rest (norms, biases, embeddings, output layer).
Both follow --lr's schedule and --weight-decay.

Under tensor parallelism (--muon-tp-mode): `blockwise` orthogonalises each rank's shard as a
matrix of its own (the update depends on the TP size, as megatron-core's); `duplicated`
all-gathers the shards, orthogonalises the whole matrix on every TP rank and keeps this rank's
part (the same update as one process); `distributed` orthogonalises each shard as part of
the whole matrix, the Gram products' partial sums added over TP (the same update as one
process, up to the order of the sums), no gather. A fused QKV weight is its Q, K and V
matrices (unless --muon-no-split-qkv); SwiGLU's fused gate and up stay one matrix, as
megatron-core keeps them.
"""

from __future__ import annotations

import re

import torch

from engine.optim.muon import MuonMatrix, TensorParallelShard, muon_step
from parallel.comm import all_gather_into, all_reduce
from parallel.tensor_parallel.sharding import tp_sharding_of

QKV_NAMES = (".q", ".k", ".v")


def takes_muon(param: torch.nn.Parameter) -> bool:
    return param.ndim == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


class MuonWithAdam(torch.optim.AdamW):
    """AdamW over the groups without "muon", Muon over those with it (their settings in the
    group, engine/optim/muon.py's names); `matrices`: a MuonMatrix per Muon parameter;
    `sharded`: a ShardedMuon (engine/optim/muon_sharded.py) when the parameters are shards."""

    def __init__(self, groups, matrices: dict | None = None, **adam_options):
        super().__init__(groups, **adam_options)
        self.matrices = dict(matrices or {})
        self.sharded = None

    @torch.no_grad()
    def step(self, closure=None):
        every = self.param_groups
        self.param_groups = [g for g in every if not g.get("muon")]
        try:
            loss = super().step(closure)
        finally:
            self.param_groups = every
        if self.sharded is not None:  # (every rank takes part, with pieces of Muon's or not)
            self.sharded.step(next((g for g in every if g.get("muon")), None), self.state)
            return loss
        for group in every:
            if group.get("muon"):
                muon_step(group, self.state, self.matrices)
        return loss


def muon_matrix(param, tp_group, tp_mode: str, split_qkv: bool) -> MuonMatrix:
    """How Muon sees `param` (held flat by the optimizer): its matrix, split into Q, K and V,
    gathered over the TP group or orthogonalised as a shard (module docstring)."""
    sharding = tp_sharding_of(param)
    shape = tuple(param.shape)
    split = sharding.dim is not None and sharding.tp_size > 1
    gathered = split and tp_mode == "duplicated"
    rows_split, groups = (), 1
    if split_qkv and sharding.names == QKV_NAMES and sharding.dim == 0:
        rows_split = tuple(size // sharding.tp_size for size in sharding.chunks)
        groups = sharding.tp_size if gathered else 1  # every rank's [q; k; v] in turn
    if split and tp_group is None and tp_mode != "blockwise":
        raise ValueError(f"Muon's {tp_mode} TP mode works over the TP group: give it")
    if split and tp_mode == "distributed":

        def tp_sum(tensor: torch.Tensor) -> None:
            all_reduce(tensor, tp_group)

        shard = TensorParallelShard(sharding.dim, sharding.tp_size, tp_sum)
        return MuonMatrix(shape=shape, rows_split=rows_split, shard=shard)
    if not gathered:
        return MuonMatrix(shape=shape, rows_split=rows_split, groups=groups)
    dim, size, rank = sharding.dim, sharding.tp_size, sharding.tp_rank

    def gather(local: torch.Tensor) -> torch.Tensor:
        rows, cols = local.shape
        out = torch.empty((size * rows, cols), dtype=local.dtype, device=local.device)
        all_gather_into(out, local.contiguous(), tp_group)
        return out if dim == 0 else torch.cat(list(out.view(size, rows, cols).unbind(0)), dim=1)

    def own(full: torch.Tensor) -> torch.Tensor:
        return full.chunk(size, dim=dim)[rank]

    return MuonMatrix(shape=shape, rows_split=rows_split, groups=groups, gather=gather, own=own)


def describe_split(chunks) -> str:
    """The line printed at start: which of this rank's weights Muon and AdamW train (layer
    numbers folded into `*`)."""
    kinds: dict[bool, dict[str, int]] = {True: {}, False: {}}
    for chunk in chunks:
        for name, param in getattr(chunk, "module", chunk).named_parameters():
            folded = re.sub(r"layers\.\d+\.", "layers.*.", name)
            names = kinds[takes_muon(param)]
            names[folded] = names.get(folded, 0) + param.numel()
    parts = []
    for muon, label in ((True, "Muon"), (False, "AdamW")):
        names = kinds[muon]
        parts.append(f"{label} {sum(names.values()):,} parameters ({', '.join(sorted(names))})")
    return "optimizer: " + "; ".join(parts)
