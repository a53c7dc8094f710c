"""--eval-global-batch-size and --eval-micro-batch-size (Megatron-LM core_v0.19.0): an
evaluation reads --eval-iters batches of the eval global batch, in eval micro-batches, whatever
the training's batches."""

from __future__ import annotations

import pytest

from engine.errors import ConfigError
from tests.test_training import base_args, pretrain, records


def _valid_losses(log) -> list[tuple[int, float]]:
    return [(r["iteration"], r["lm_loss"]) for r in records(log) if r.get("split") == "valid"]


def test_eval_batches_are_their_own(dataset_prefix, tokenizer_model, tmp_path):
    """With the weights held still (--lr 0), two runs whose training batches differ evaluate
    the same valid samples to the same losses when their evaluation batches agree. The first
    runs on two pipeline stages, whose transfers are shaped by the micro-batch: an evaluation
    that ignored --eval-micro-batch-size in its reading or in its schedule would fail."""
    still = {"--lr": "0", "--min-lr": "0", "--train-iters": "3", "--eval-interval": "1"}
    still |= {"--eval-iters": "2", "--hidden-dropout": "0.0", "--attention-dropout": "0.0"}
    own, plain = tmp_path / "own.jsonl", tmp_path / "plain.jsonl"
    own_batches = {"--global-batch-size": "8", "--log-jsonl": str(own)}
    own_batches |= {"--pipeline-model-parallel-size": "2"}
    eval_flags = ["--eval-global-batch-size", "4", "--eval-micro-batch-size", "1"]
    pretrain(2, base_args(dataset_prefix, tokenizer_model, **still, **own_batches) + eval_flags)
    plain_batches = {"--global-batch-size": "4", "--log-jsonl": str(plain)}
    pretrain(1, base_args(dataset_prefix, tokenizer_model, **still, **plain_batches))
    found, expected = _valid_losses(own), _valid_losses(plain)
    assert [i for i, _ in found] == [i for i, _ in expected] and len(found) >= 2
    assert [v for _, v in found] == pytest.approx([v for _, v in expected], rel=1e-5)
    # the same run with the training's batches evaluates other samples (8 a batch)
    other = tmp_path / "other.jsonl"
    other_batches = {"--global-batch-size": "8", "--log-jsonl": str(other)}
    pretrain(2, base_args(dataset_prefix, tokenizer_model, **still, **other_batches))
    assert [v for _, v in _valid_losses(other)] != pytest.approx([v for _, v in expected])


def test_eval_batches_that_do_not_divide_are_refused(dataset_prefix, tokenizer_model):
    from engine.pretrain import parse
    from engine.train.preflight import prepare

    args = base_args(dataset_prefix, tokenizer_model)
    with pytest.raises(ConfigError, match="--eval-global-batch-size 6 must be a multiple of"):
        prepare(parse(args + ["--eval-global-batch-size", "6", "--eval-micro-batch-size", "4"]), 1)
