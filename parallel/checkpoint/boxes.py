"""Checkpoint boxes: the rectangles of logical global tensors that a local parameter (or a
distributed-optimizer shard of one) holds, which checkpoints save and load so that any layout
can read any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallel.tensor_parallel.sharding import TPSharding


@dataclass(frozen=True)
class Box:
    """A rectangular part of a logical global tensor, stored contiguously in a local tensor's
    flattened layout at [flat_start, flat_end)."""

    suffix: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int
    flat_end: int


def _row_boxes(shape: tuple[int, ...], start: int, end: int):
    """A flat range of a 1-D or 2-D row-major tensor as (offsets, sizes) boxes: a partial
    first row, whole rows, a partial last row."""
    if len(shape) == 1:
        return [((start,), (end - start,))] if end > start else []
    if len(shape) != 2:
        raise ValueError(f"only 1-D and 2-D parameters are supported, got shape {shape}")
    width = shape[1]
    boxes = []
    row, col = divmod(start, width)
    if col and start < end:
        stop = min(end, (row + 1) * width)
        boxes.append(((row, col), (1, stop - start)))
        start, row = stop, row + 1
    full_rows = (end - start) // width
    if full_rows > 0:
        boxes.append(((row, 0), (full_rows, width)))
        start, row = start + full_rows * width, row + full_rows
    if start < end:
        boxes.append(((row, 0), (1, end - start)))
    return boxes


def checkpoint_boxes(
    local_shape,
    sharding: TPSharding,
    flat_start: int = 0,
    flat_end: int | None = None,
    real_rows: int | None = None,
) -> list[Box]:
    """The global boxes covered by elements [flat_start, flat_end) of a local parameter (the
    whole parameter by default, or a distributed-optimizer shard of it).

    real_rows clips a vocabulary-padded parameter to its real rows: the padding is not part of
    the logical tensor, so checkpoints do not depend on the TP size's padding.
    """
    shape = tuple(local_shape)
    total = math.prod(shape)
    flat_end = total if flat_end is None else flat_end
    width = shape[1] if len(shape) == 2 else 1
    out = []
    for offsets, sizes in _row_boxes(shape, flat_start, flat_end):
        for piece in sharding.pieces(shape):
            lo = [max(o, s.start) for o, s in zip(offsets, piece.local, strict=False)]
            hi = [min(o + n, s.stop) for o, n, s in zip(offsets, sizes, piece.local, strict=False)]
            if any(h <= low for low, h in zip(lo, hi, strict=False)):
                continue
            global_shape = list(piece.global_shape)
            glo = [
                low - s.start + g
                for low, s, g in zip(lo, piece.local, piece.global_offset, strict=False)
            ]
            ghi = [
                h - s.start + g
                for h, s, g in zip(hi, piece.local, piece.global_offset, strict=False)
            ]
            if real_rows is not None:
                global_shape[0] = real_rows
                cut = max(0, ghi[0] - real_rows)
                ghi[0] -= cut
                hi[0] -= cut
                if ghi[0] <= glo[0]:
                    continue
            box_sizes = tuple(h - low for low, h in zip(lo, hi, strict=False))
            if len(shape) == 2 and box_sizes[0] > 1 and box_sizes[1] != width:
                raise AssertionError("a checkpoint box must be contiguous in the local tensor")
            start = lo[0] * width + (lo[1] if len(shape) == 2 else 0)
            out.append(
                Box(
                    piece.suffix,
                    tuple(global_shape),
                    tuple(glo),
                    box_sizes,
                    start,
                    start + math.prod(box_sizes),
                )
            )
    return out
