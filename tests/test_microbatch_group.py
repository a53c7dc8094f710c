"""--microbatch-group-size-per-virtual-pipeline-stage: the interleaved schedule's micro-batch
groups, each rank's order held to megatron-core's schedule table and warm-up count, and a run
whose micro-batches are no multiple of the stages trained to a single stage's losses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from parallel.errors import ConfigError
from parallel.pipeline.tables import Action, interleaved
from parallel.pipeline.validate import validate
from tests.requirements import require
from tests.test_training import base_args, losses, pretrain

CASES = [  # (p, v, m, group)
    (2, 2, 4, None),
    (2, 2, 2, None),
    (4, 2, 8, None),
    (2, 2, 5, 3),
    (2, 3, 6, 3),
    (2, 2, 7, 4),
    (4, 2, 10, 6),
    (3, 2, 9, 9),
    (2, 2, 8, 8),
]


def megatron_order(p: int, v: int, m: int, group: int | None, rank: int) -> list[Action]:
    """The compute order of megatron-core's interleaved 1F1B on `rank`: its warm-up count and
    schedule table, forward k then backward k in the steady state (its loop's order)."""
    from megatron.core.pipeline_parallel import schedules

    g = group or p
    pp_group = SimpleNamespace(size=lambda: p, rank=lambda: rank)
    sizes = SimpleNamespace(pp_group=pp_group, virtual_pipeline_model_parallel_size=v)
    total, _, warmup, remaining = schedules.get_pp_rank_microbatches(
        m, v, g, p2p_communicator=sizes
    )
    table = schedules.get_schedule_table(m, v, g)

    def forward(k):
        return Action("F", table[k][1], table[k][0])

    def backward(k):
        return Action("B", v - 1 - table[k][1], table[k][0])

    order = [forward(k) for k in range(warmup)]
    for k in range(remaining):
        order += [forward(warmup + k), backward(k)]
    return order + [backward(k) for k in range(remaining, total)]


@pytest.mark.parametrize("p, v, m, group", CASES)
def test_each_rank_runs_megatron_cores_order(p, v, m, group):
    require("megatron.core")
    table = interleaved(p, v, m, group)
    validate(table)  # every transfer matched, no deadlock, under gloo's and NCCL's rules
    for rank in range(p):
        assert list(table.ranks[rank]) == megatron_order(p, v, m, group, rank), rank


@pytest.mark.parametrize(
    "p, m, group, problem",
    [
        (2, 5, None, "multiple"),  # the default group p leaves one
        (2, 4, 1, "must lie between"),
        (2, 4, 5, "must lie between"),
        (3, 7, 5, "not 2"),
    ],
)
def test_groups_megatron_core_refuses_are_refused(p, m, group, problem):
    with pytest.raises(ConfigError, match=problem):
        interleaved(p, 2, m, group)


def test_a_run_of_five_micro_batches_on_two_stages(dataset_prefix, tokenizer_model, tmp_path):
    found = []
    shape = {"--global-batch-size": "10", "--micro-batch-size": "2", "--train-iters": "3"}
    shape |= {"--hidden-dropout": "0.0", "--attention-dropout": "0.0"}
    for name, world, extra in (
        ("single", 1, []),
        (
            "grouped",
            2,
            [
                *("--pipeline-model-parallel-size", "2"),
                *("--num-layers-per-virtual-pipeline-stage", "1"),
                *("--microbatch-group-size-per-virtual-pipeline-stage", "3"),
            ],
        ),
    ):
        log = tmp_path / f"{name}.jsonl"
        args = base_args(dataset_prefix, tokenizer_model, **shape, **{"--log-jsonl": str(log)})
        pretrain(world, args + extra)
        found.append(losses(log))
    assert list(found[1]) == [1, 2, 3]
    assert list(found[1].values()) == pytest.approx(list(found[0].values()), rel=1e-5)
