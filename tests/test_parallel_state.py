"""ParallelState: rank layout (TP innermost, then DP, then PP), real groups, clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine.errors import ConfigError
from parallel.state import ParallelState, check_layout
from tests.distributed import run_ranks


def _layout(rank, world):
    state = ParallelState.build(tp=2, pp=2, dp=2)
    second = ParallelState.build(tp=4, pp=1)  # several states live in one process
    sums = {}
    for name in ("tp_group", "dp_group", "pp_group", "model_parallel_group", "embedding_group"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=getattr(state, name))
        sums[name] = t.item()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=second.tp_group)
    return {
        "coords": (state.tp_rank, state.dp_rank, state.pp_rank),
        "ranks": (state.tp_ranks, state.dp_ranks, state.pp_ranks),
        "sums": sums,
        "second": (second.tp_rank, second.dp_size, t.item()),
        "stages": (state.is_first_stage, state.is_last_stage, state.next_rank, state.prev_rank),
    }


def test_groups_on_eight_ranks():
    results = run_ranks(_layout, 8)
    for rank, r in enumerate(results):
        tp, dp, pp = rank % 2, (rank // 2) % 2, rank // 4
        assert r["coords"] == (tp, dp, pp)
        base_tp = rank - tp
        assert r["ranks"][0] == (base_tp, base_tp + 1)
        assert r["ranks"][1] == (pp * 4 + tp, pp * 4 + 2 + tp)
        assert r["ranks"][2] == (dp * 2 + tp, 4 + dp * 2 + tp)
        assert r["sums"]["tp_group"] == 2 * base_tp + 1
        assert r["sums"]["dp_group"] == sum(r["ranks"][1])
        assert r["sums"]["pp_group"] == sum(r["ranks"][2])
        assert r["sums"]["embedding_group"] == sum(r["ranks"][2])  # first + last stage
        mp = [p * 4 + dp * 2 + t for p in range(2) for t in range(2)]
        assert r["sums"]["model_parallel_group"] == sum(mp)
        assert r["second"] == (rank % 4, 2, sum(range(rank - rank % 4, rank - rank % 4 + 4)))
        assert r["stages"][:2] == (pp == 0, pp == 1)
        assert r["stages"][2] == r["stages"][3] == r["ranks"][2][1 - pp]


def test_layout_errors_are_clear():
    assert check_layout(8, 2, 2) == 2
    with pytest.raises(ConfigError, match="world size 6 is not divisible by tensor-model"):
        check_layout(6, 4, 1)
    with pytest.raises(ConfigError, match=r"world size 8 != tensor 2 x pipeline 1 x data 2"):
        check_layout(8, 2, 1, 2)
    with pytest.raises(ConfigError, match="must be at least 1"):
        check_layout(8, 0, 1)


def test_local_state_has_no_groups():
    state = ParallelState.local()
    assert state.tp_group is None and state.world_size == 1 and state.is_last_stage
