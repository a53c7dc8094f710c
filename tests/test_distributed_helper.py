"""The spawn helper itself: real collectives, results back, failures surfaced with tracebacks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks


def _sum_ranks(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item(), torch.get_num_threads()


def _fail_on_two(rank, world):
    if rank == 2:
        raise ValueError("rank two is unhappy")
    dist.barrier()


def test_collectives_and_threads():
    results = run_ranks(_sum_ranks, 4)
    assert results == [(6.0, 1)] * 4


def test_failing_rank_traceback_is_shown():
    with pytest.raises(AssertionError, match=r"rank 2 of 4 failed:[\s\S]*rank two is unhappy"):
        run_ranks(_fail_on_two, 4, timeout=60)
