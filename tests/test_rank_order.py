"""--use-tp-pp-dp-mapping: the other rank order (tp-cp-pp-dp), its groups held to
megatron-core's RankGenerator, each rank's coordinates to its groups, and a run trained in
either order to the same losses."""

from __future__ import annotations

import pytest

from parallel.state import ParallelState, layout_groups
from tests.requirements import require
from tests.test_training import base_args, losses, pretrain

LAYOUTS = [(2, 1, 2, 2), (1, 2, 2, 2), (2, 2, 1, 2), (1, 1, 4, 2), (2, 1, 3, 2), (1, 1, 2, 3)]
# megatron-core's names for our kinds of group
MEGATRON_KINDS = {
    "tp": "tp",
    "cp": "cp",
    "dp": "dp",
    "dp_cp": "dp-cp",
    "pp": "pp",
    "model": "tp-pp",
}


@pytest.mark.parametrize("pp_inside_dp", [False, True], ids=["tp-cp-dp-pp", "tp-cp-pp-dp"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: "tp{}-cp{}-dp{}-pp{}".format(*s))
def test_groups_equal_megatron_cores(layout, pp_inside_dp):
    require("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    tp, cp, dp, pp = layout
    order = "tp-cp-ep-pp-dp" if pp_inside_dp else "tp-cp-ep-dp-pp"
    theirs = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    ours = layout_groups(tp, cp, dp, pp, pp_inside_dp)
    for kind, name in MEGATRON_KINDS.items():
        assert sorted(ours[kind]) == sorted(theirs.get_ranks(name)), kind


@pytest.mark.parametrize("pp_inside_dp", [False, True])
def test_each_ranks_coordinates_place_it_in_its_groups(pp_inside_dp):
    tp, cp, dp, pp = 2, 2, 3, 2
    groups = layout_groups(tp, cp, dp, pp, pp_inside_dp)
    for rank in range(tp * cp * dp * pp):
        state = ParallelState(tp, pp, dp, cp, rank=rank, pp_inside_dp=pp_inside_dp)
        for kind, coordinate in (
            ("tp", state.tp_rank),
            ("cp", state.cp_rank),
            ("dp", state.dp_rank),
            ("pp", state.pp_rank),
        ):
            (group,) = [g for g in groups[kind] if rank in g]
            assert group.index(rank) == coordinate, (kind, rank)


def test_a_run_in_either_order_trains_to_the_same_losses(dataset_prefix, tokenizer_model, tmp_path):
    """PP2 x DP2: the order moves work between global ranks, not the arithmetic."""
    found = []
    for name, extra in (("default", []), ("mapped", ["--use-tp-pp-dp-mapping"])):
        log = tmp_path / f"{name}.jsonl"
        run = {
            "--train-iters": "3",
            "--pipeline-model-parallel-size": "2",
            "--log-jsonl": str(log),
        }
        pretrain(4, base_args(dataset_prefix, tokenizer_model, **run) + extra)
        found.append(losses(log))
    assert found[0] == found[1] and len(found[0]) == 3
