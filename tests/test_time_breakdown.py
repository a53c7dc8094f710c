"""The time breakdown of the logged iterations (time/<part>, parallel/timing.py): the measured
parts of a step must add up to the iteration's wall time within 5%, with and without pipeline
parallelism, and the parts the layout has must be there."""

from __future__ import annotations

from tests.test_training import base_args, pretrain, records

PARTS = {"batch-generator", "forward-compute", "backward-compute", "grads-sync", "loss-sync",
         "optimizer", "exit-check"}  # fmt: skip


def test_parts_add_up_to_the_iteration_time(dataset_prefix, tokenizer_model, tmp_path):
    for world, extra in ((1, {}), (2, {"--pipeline-model-parallel-size": "2"})):
        log = str(tmp_path / f"log{world}.jsonl")
        args = base_args(
            dataset_prefix,
            tokenizer_model,
            **extra,
            **{"--train-iters": "8", "--log-interval": "2", "--log-jsonl": log},
            # steps long enough that the loop's own bookkeeping (about 1-3 ms an iteration, not
            # a part) stays well inside the 5%
            **{"--hidden-size": "128", "--seq-length": "128"},
            **{"--save": str(tmp_path / f"c{world}"), "--save-interval": "4"},
            **{"--eval-interval": "4"},
        )
        assert pretrain(world, args) == [0] * world
        train = [r for r in records(log) if "split" not in r]
        assert len(train) == 4
        for record in train:
            parts = {k.removeprefix("time/"): v for k, v in record.items() if k.startswith("time/")}
            expected = PARTS | ({"pipeline-wait"} if world > 1 else set())
            assert expected <= set(parts), (world, sorted(parts))
            total, wall = sum(parts.values()), record["iteration_time_s"]
            assert abs(total - wall) <= 0.05 * wall, (world, record["iteration"], parts, wall)
        # the checkpoint saved and the evaluation at iteration 4 count in the next window
        later = train[2]
        assert later["time/save-checkpoint"] > 0 and later["time/evaluate"] > 0
        # (before any save, only the check for an asynchronous copy in flight counts there)
        assert train[0].get("time/save-checkpoint", 0.0) < 0.1 * later["time/save-checkpoint"]
