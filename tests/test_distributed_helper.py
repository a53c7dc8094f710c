"""The spawn helper itself: real collectives, results back, failures surfaced with tracebacks."""

from __future__ import annotations

import re

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


def _rank_zero_returns_first(rank, world):
    """Rank 0 returns once every rank is here; the others then set up a group among
    themselves and use it while rank 0 is on its way out."""
    dist.barrier()
    if rank == 0:
        return "early"
    group = dist.new_group([1, 2, 3], use_local_synchronization=True)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    return t.item()


def test_collectives_and_threads():
    results = run_ranks(_sum_ranks, 4)
    assert results == [(6.0, 1)] * 4


def test_failing_rank_traceback_is_shown():
    with pytest.raises(AssertionError) as failure:
        run_ranks(_fail_on_two, 4, timeout=60)
    message = str(failure.value)
    assert re.match(r"rank 2 of 4 failed \(the others: 0 \w+, 1 \w+, 3 \w+\):\n", message)
    assert "rank two is unhappy" in message


def test_a_rank_that_returns_early_leaves_the_store_to_the_others():
    # Without the check-out in parallel/local_ranks.py rank 0 exits here and takes its gloo
    # connections with it while the others still set up a group.
    assert run_ranks(_rank_zero_returns_first, 4, timeout=60) == ["early", 6.0, 6.0, 6.0]
