"""Which part of a full ("global") tensor each rank's local tensor holds.

A tensor-parallel parameter is split along one dimension. A fused parameter (the QKV
projection, SwiGLU's gate+up) is several logical tensors stacked along that dimension, each
split on its own, so rank r holds [q_r; k_r; v_r]. `TPSharding` records this, and `pieces()`
turns a local tensor into (logical name, global shape, global offset, local slice) boxes: what
checkpoints save and load (any layout can read any other) and converters assemble.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.comm import all_gather_into


@dataclass(frozen=True)
class Piece:
    """One box of a logical global tensor held locally.

    suffix: appended to the parameter name ("" or ".q", ".k", ...); global_shape and
    global_offset locate the box in the logical tensor; local: slices of the local tensor.
    """

    suffix: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local: tuple[slice, ...]


@dataclass(frozen=True)
class TPSharding:
    """How a local parameter relates to its global tensor(s) across the TP group."""

    dim: int | None = None  # None: replicated on every TP rank
    chunks: tuple[int, ...] = ()  # global sizes along dim of the stacked logical tensors
    names: tuple[str, ...] = ()  # their key suffixes, "" for an unfused tensor
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def replicated(self) -> bool:
        return self.dim is None

    def pieces(self, local_shape: tuple[int, ...]) -> list[Piece]:
        shape = tuple(local_shape)
        full = tuple(slice(0, n) for n in shape)
        if self.replicated:
            return [Piece("", shape, (0,) * len(shape), full)]
        pieces, start = [], 0
        for size, name in zip(self.chunks, self.names, strict=False):
            local = size // self.tp_size
            global_shape = shape[: self.dim] + (size,) + shape[self.dim + 1 :]
            offset = [0] * len(shape)
            offset[self.dim] = self.tp_rank * local
            slices = list(full)
            slices[self.dim] = slice(start, start + local)
            pieces.append(Piece(name, global_shape, tuple(offset), tuple(slices)))
            start += local
        return pieces


REPLICATED = TPSharding()


def split_sharding(dim: int, chunks, tp_rank: int, tp_size: int, names=None) -> TPSharding:
    chunks = tuple(int(c) for c in chunks)
    if names is None:
        names = ("",) if len(chunks) == 1 else tuple(f".{i}" for i in range(len(chunks)))
    return TPSharding(dim, chunks, tuple(names), tp_rank, tp_size)


def set_tp_sharding(param: torch.Tensor, sharding: TPSharding) -> None:
    param.tp_sharding = sharding


def tp_sharding_of(param: torch.Tensor) -> TPSharding:
    return getattr(param, "tp_sharding", REPLICATED)


def mark_tp_partial_grad(param: torch.Tensor) -> None:
    """A replicated parameter that each TP rank applies to different data (norms and biases on
    sequence-split activations under SP, per-head QK norms on TP-split heads): each rank's
    gradient is partial and must be summed over the TP group before the optimizer step."""
    param.tp_partial_grad = True


def has_tp_partial_grad(param: torch.Tensor) -> bool:
    return getattr(param, "tp_partial_grad", False)


def local_from_full(full: torch.Tensor, sharding: TPSharding) -> torch.Tensor:
    """This rank's local tensor cut from the full (TP=1 layout) tensor."""
    if sharding.replicated:
        return full.clone()
    parts, start = [], 0
    for size in sharding.chunks:
        local = size // sharding.tp_size
        begin = start + sharding.tp_rank * local
        parts.append(full.narrow(sharding.dim, begin, local))
        start += size
    return torch.cat(parts, dim=sharding.dim).clone()


def full_from_local(local: torch.Tensor, sharding: TPSharding, tp_group) -> torch.Tensor:
    """Gather the full (TP=1 layout) tensor from every TP rank (a collective on tp_group)."""
    if sharding.replicated or sharding.tp_size == 1:
        return local.detach().clone()
    size = sharding.tp_size
    moved = local.detach().movedim(sharding.dim, 0).contiguous()
    gathered = torch.empty(
        (size * moved.shape[0],) + moved.shape[1:], dtype=local.dtype, device=local.device
    )
    all_gather_into(gathered, moved, tp_group)
    per_rank = gathered.chunk(size, dim=0)
    parts, start = [], 0
    for chunk in sharding.chunks:
        local_size = chunk // size
        parts.extend(r[start : start + local_size] for r in per_rank)
        start += local_size
    return torch.cat(parts, dim=0).movedim(0, sharding.dim).contiguous()


def is_tp_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True on every TP rank but the first for a replicated parameter: count it once."""
    return tp_sharding_of(param).replicated and tp_rank > 0
