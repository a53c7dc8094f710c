"""Weight initialisation that draws only this rank's slice, on its device, with the values the
full weight has at every TP size.

Element (i, j) of a full [rows, cols] weight is a function of the parameter's seed and its
position i x cols + j alone: two 32-bit hashes of (seed, position) give two uniform numbers,
and the Box-Muller transform turns them into one standard normal (in float64, then scaled and
rounded to fp32). A rank computes the positions of its own slice (parallel/tensor_parallel/
sharding.py: split rows or columns, stacked partitions such as q, k, v) and draws those
alone, so no rank builds a full weight, and the TP=1 model and every TP layout start from
the same values. Integer hashing is exact on every device; the float64 transform may differ
in the last bit between a CPU and a GPU, which rounding to fp32 almost always hides.

Drawn in chunks of CHUNK elements, so the scratch memory stays small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parallel.tensor_parallel.sharding import REPLICATED, TPSharding, local_from_full

CHUNK = 1 << 22
_MASK32 = (1 << 32) - 1


@dataclass(frozen=True)
class NormalInit:
    """Normal(0, std) weights (Megatron-LM's init_method_normal)."""

    std: float


InitMethod = NormalInit


def normal_init(std: float) -> NormalInit:
    return NormalInit(std)


def scaled_normal_init(std: float, num_layers: int) -> NormalInit:
    """Output projections of residual branches: std / sqrt(2 * num_layers)."""
    return NormalInit(std / math.sqrt(2.0 * num_layers))


def _int32(value: int) -> int:
    """A 32-bit pattern as the int32 that holds it."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 integer hash on int32 tensors (two's-complement wrapping, logical
    shifts by masking): the same bits on every device."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _int32(0x7FEB352D)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _int32(0x846CA68B)
    return x ^ ((x >> 16) & 0xFFFF)


def _scalar_hash(value: int) -> int:
    return int(hash32(torch.tensor([_int32(value)], dtype=torch.int32))[0])


def _unit(bits: torch.Tensor) -> torch.Tensor:
    """int32 bits read as unsigned, mapped into (0, 1) in float64."""
    unsigned = bits.double() + (bits < 0).double() * 2.0**32
    return (unsigned + 0.5) / 2.0**32


def standard_normal_at(seed: int, low: torch.Tensor, high: int = 0) -> torch.Tensor:
    """Standard normal float64 values at positions high x 2^32 + low (low: int32 bits) under
    `seed` (module docstring): a key per position, two hashes of it, Box-Muller."""
    salt = _scalar_hash(_scalar_hash(seed >> 32) ^ _int32(seed) ^ _scalar_hash(high + 0x9E37))
    key = hash32(low ^ salt)
    first = hash32(key ^ _int32(0x68E31DA4))
    second = hash32(key ^ _int32(0xB5297A4D))
    return torch.sqrt(-2.0 * torch.log(_unit(first))) * torch.cos(2.0 * math.pi * _unit(second))


def _local_indices(size: int, dim: int, sharding: TPSharding, device) -> torch.Tensor:
    """The full-tensor indices along `dim` that this rank's slice holds, in its order: the
    slice sharding.py's `local_from_full` cuts, taken from the indices themselves."""
    indices = torch.arange(size, device=device)
    if sharding.replicated or sharding.dim != dim:
        return indices
    along = [-1 if d == dim else 1 for d in range(sharding.dim + 1)]
    return local_from_full(indices.view(along), sharding).flatten()


def _normal_block(seed: int, rows: torch.Tensor, cols: torch.Tensor, width: int) -> torch.Tensor:
    """Values at [rows x cols] of a full weight `width` columns wide."""
    if (int(rows.max()) + 1) * width < 1 << 31:  # positions fit int32: no high part
        low = rows.to(torch.int32)[:, None] * width + cols.to(torch.int32)[None, :]
        return standard_normal_at(seed, low)
    positions = rows[:, None] * width + cols[None, :]
    low = positions & _MASK32
    low = torch.where(low >= 1 << 31, low - (1 << 32), low).to(torch.int32)
    highs = positions >> 32
    first, last = int(highs.min()), int(highs.max())
    values = standard_normal_at(seed, low, first)
    for high in range(first + 1, last + 1):
        values = torch.where(highs == high, standard_normal_at(seed, low, high), values)
    return values


def draw_local(
    shape: tuple[int, int],
    sharding: TPSharding,
    init: NormalInit,
    seed: int,
    device: torch.device | str | None = None,
    drawn_rows: int | None = None,
) -> torch.Tensor:
    """This rank's fp32 slice of the full [rows, cols] weight (module docstring); rows from
    `drawn_rows` on are zero (a padded vocabulary's padding)."""
    rows, cols = shape
    device = torch.device(device or "cpu")
    row_index = _local_indices(rows, 0, sharding, device)
    col_index = _local_indices(cols, 1, sharding, device)
    out = torch.empty(len(row_index), len(col_index), dtype=torch.float32, device=device)
    if device.type == "meta":  # shapes only (converters build on meta): nothing to draw
        return out
    step = max(1, CHUNK // max(1, len(col_index)))
    for start in range(0, len(row_index), step):
        part = row_index[start : start + step]
        values = _normal_block(seed, part, col_index, cols) * init.std
        if drawn_rows is not None:
            values.masked_fill_((part >= drawn_rows)[:, None], 0.0)
        out[start : start + step] = values
    return out


def draw_full(shape: tuple[int, int], init: NormalInit, seed: int, device=None) -> torch.Tensor:
    """The whole fp32 weight (a replicated parameter's), drawn the same way."""
    return draw_local(shape, REPLICATED, init, seed, device)
