"""The pieces under checkpoints: global boxes of (parts of) local tensors, and metadata loading
that unpickles nothing but DCP's own classes."""

from __future__ import annotations

import pytest
import torch

from parallel.checkpoint.boxes import checkpoint_boxes
from parallel.tensor_parallel.sharding import local_from_full, split_sharding


@pytest.mark.parametrize("seed", range(20))
def test_boxes_of_any_flat_range_cover_exactly_its_elements(seed):
    generator = torch.Generator().manual_seed(seed)

    def pick(low, high):
        return int(torch.randint(low, high, (1,), generator=generator))

    tp, rank = pick(1, 4), 0
    rank = pick(0, tp)
    chunks = [pick(1, 4) * tp for _ in range(pick(1, 4))]
    dim = pick(0, 2)
    other = pick(1, 7)
    full_shape = [sum(chunks), other] if dim == 0 else [other, sum(chunks)]
    full = torch.arange(torch.Size(full_shape).numel()).view(full_shape)
    sharding = split_sharding(dim, chunks if dim == 0 else [sum(chunks)], rank, tp)
    local = local_from_full(full, sharding)
    start = pick(0, local.numel())
    end = pick(start, local.numel() + 1)
    real_rows = pick(1, full_shape[0] + 1) if dim == 0 and len(chunks) == 1 else None
    seen = []
    flat = local.reshape(-1)
    for box in checkpoint_boxes(local.shape, sharding, start, end, real_rows):
        values = flat[box.flat_start : box.flat_end].view(box.sizes)
        # the box's elements are the global tensor's elements at its offset
        parts = full if len(chunks) == 1 or dim != 0 else None
        if parts is None:  # fused: the logical tensor is one chunk of the full one
            index = [".0", ".1", ".2"].index(box.suffix)
            parts = full[sum(chunks[:index]) : sum(chunks[: index + 1])]
        region = parts[
            tuple(slice(o, o + n) for o, n in zip(box.global_offset, box.sizes, strict=True))
        ]
        assert torch.equal(values, region)
        seen.append(values.reshape(-1))
    covered = torch.cat(seen) if seen else torch.zeros(0, dtype=torch.long)
    expected = flat[start:end]
    if real_rows is not None:  # rows past real_rows are padding and never saved
        expected = expected[expected < real_rows * full_shape[1]]
    assert sorted(covered.tolist()) == sorted(expected.tolist())
