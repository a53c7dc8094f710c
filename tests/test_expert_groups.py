"""The expert process groups (megatron-core's parallel folding, parallel/expert_parallel/groups.py)
held to megatron-core's RankGenerator over many layouts in both rank orders, layouts that cannot
be refused in one line, and ParallelState.build's groups on 8 gloo ranks equal to the layout's."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch.distributed as dist

from parallel.errors import ConfigError
from parallel.expert_parallel.groups import expert_data_parallel_size, expert_layout_groups
from parallel.state import ParallelState
from tests.distributed import run_ranks
from tests.requirements import require

MEGATRON_KINDS = {
    "ep": "ep",
    "expert_dp": "dp",
    "expert_tp": "tp",
    "expert_tp_ep": "tp-ep",
    "expert_tp_ep_pp": "tp-ep-pp",
}


def _layouts():
    for tp, cp, dp, pp, ep, etp in itertools.product(
        (1, 2), (1, 2), (1, 2, 4), (1, 2), (1, 2, 4), (1, 2)
    ):
        if (tp * cp * dp) % (ep * etp) == 0:
            yield tp, cp, dp, pp, ep, etp


@pytest.mark.parametrize("pp_inside_dp", [False, True], ids=["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
def test_groups_equal_megatron_cores(pp_inside_dp):
    require("megatron.core")
    warnings.filterwarnings("ignore")
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-pp-dp" if pp_inside_dp else "tp-cp-ep-dp-pp"
    compared = 0
    for tp, cp, dp, pp, ep, etp in _layouts():
        edp = expert_data_parallel_size(tp, cp, dp, ep, etp)
        if pp_inside_dp and pp > 1 and edp != dp:
            with pytest.raises(ConfigError, match="--use-tp-pp-dp-mapping with pipeline"):
                expert_layout_groups(tp, cp, dp, pp, ep, etp, pp_inside_dp)
            continue
        ours = expert_layout_groups(tp, cp, dp, pp, ep, etp, pp_inside_dp)
        theirs = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
        for kind, name in MEGATRON_KINDS.items():
            assert sorted(ours[kind]) == sorted(theirs.get_ranks(name)), (tp, cp, dp, pp, ep, etp)
            compared += 1
    assert compared > 190


def test_a_layout_the_experts_do_not_divide_is_refused():
    with pytest.raises(ConfigError, match="expert-tensor-parallel-size 1 x expert-model-para"):
        expert_data_parallel_size(2, 1, 3, ep=4, etp=1)


def _built(rank, world, layout):
    tp, pp, ep, etp = layout
    state = ParallelState.build(tp=tp, pp=pp, ep=ep, etp=etp)
    found = {}
    for name, group in (
        ("ep", state.ep_group),
        ("expert_dp", state.expert_dp_group),
        ("expert_tp", state.expert_tp_group),
        ("expert_tp_ep_pp", state.expert_tp_ep_pp_group),
    ):
        found[name] = dist.get_process_group_ranks(group) if group is not None else [rank]
    return found, state.ep_rank


@pytest.mark.parametrize("layout", [(2, 1, 2, 1), (1, 2, 2, 1), (2, 2, 2, 2)], ids=str)
def test_built_groups_are_the_layouts(layout):
    tp, pp, ep, etp = layout
    dp = 8 // (tp * pp)
    expected = expert_layout_groups(tp, 1, dp, pp, ep, etp)
    for rank, (found, ep_rank) in enumerate(run_ranks(_built, 8, layout)):
        for kind in ("ep", "expert_dp", "expert_tp", "expert_tp_ep_pp"):
            (mine,) = [g for g in expected[kind] if rank in g]
            assert found[kind] == mine, (rank, kind)
        assert found["ep"].index(rank) == ep_rank
