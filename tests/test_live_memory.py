"""engine/planning/live_memory.py: the peak of live CPU storages, counted by hand on known
allocations, views, autograd's saved tensors (held with no Python reference), a storage resized
to nothing, and a tensor made before the count started."""

from __future__ import annotations

import torch

from engine.planning.live_memory import LiveStoragePeak

FLOAT = 4


def test_allocations_views_and_frees_are_counted_once():
    before = torch.empty(250)  # made before: counted from the start, freed inside
    with LiveStoragePeak() as count:
        start = count.current
        a = torch.empty(1000)
        b = torch.empty(2000)
        view = b[10:]  # the same storage: nothing more
        assert count.current - start == 3000 * FLOAT
        del a, before
        c = torch.empty(500)
        end = count.current
    assert count.peak - start == 3000 * FLOAT
    assert end - start == (2000 + 500 - 250) * FLOAT
    assert view.numel() and c.numel()


def test_saved_tensors_count_until_backward_frees_them():
    x = torch.randn(1000, requires_grad=True)
    with LiveStoragePeak() as count:
        start = count.current
        loss = x.exp().sum()  # exp's output: no Python reference, saved for backward
        held = count.current - start
        loss.backward()
        del loss
        after = count.current - start
    assert held == 1000 * FLOAT + FLOAT  # the saved output and the scalar loss
    assert after == 1000 * FLOAT  # x.grad; the saved output is gone
    assert count.peak - start >= 2 * 1000 * FLOAT  # saved output and gradient at once


def test_a_storage_resized_to_nothing_stops_counting():
    with LiveStoragePeak() as count:
        start = count.current
        weights = torch.empty(4000)
        weights.untyped_storage().resize_(0)
        weights.view(-1)  # any operation that sees it again (reading none of it)
        assert count.current - start == 0
    assert count.peak - start == 4000 * FLOAT


def test_the_bytes_at_the_peak_are_told_by_the_operation_that_made_them():
    kept = torch.empty(100)
    with LiveStoragePeak(by_origin=True) as count:
        ones = torch.ones(1000)
        doubled = ones * 2
        del ones
        small = torch.zeros(10)
    assert count.at_peak["aten.ones"] == count.at_peak["aten.mul"] == 1000 * FLOAT
    assert count.at_peak["before"] >= 100 * FLOAT and "aten.zeros" not in count.at_peak
    assert kept.numel() and doubled.numel() and small.numel()
