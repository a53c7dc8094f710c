"""One writer of the configuration: after parsing, engine/config/resolve.py returns the
configs with everything derived filled in, and every config is frozen, so every check and the
whole training run after it can only read them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.config.configs import Configs
from engine.pretrain import parse
from engine.train.preflight import prepare
from tests.distributed import run_ranks

SHAPE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--num-workers", "0",
]  # fmt: skip


def test_every_config_is_frozen():
    cfg = parse(SHAPE + ["--vocab-size", "64", "--train-iters", "2"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = None
    for field in dataclasses.fields(Configs):
        section = getattr(cfg, field.name)
        if not dataclasses.is_dataclass(section):
            continue
        first = dataclasses.fields(section)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, first, getattr(section, first))


def test_resolve_fills_in_what_is_derived_and_leaves_the_parsed_configs(tmp_path):
    paths = tmp_path / "paths.json"
    paths.write_text(json.dumps({"train": "a", "valid": "b"}))
    parsed = parse(
        SHAPE
        + ["--vocab-size", "100", "--train-samples", "21", "--global-batch-size", "4"]
        + ["--sequence-parallel", "--per-split-data-args-path", str(paths)]
    )
    from engine.config.resolve import resolve

    resolved = resolve(parsed, 2, vocab_size_of=lambda tokenizer: tokenizer.vocab_size + 1)
    assert resolved.training.train_iters == 5  # whole global batches of --train-samples
    assert resolved.parallel.sequence_parallel is False  # no tensor parallelism to split over
    assert resolved.tokenizer.vocab_size == 100  # NullTokenizer reads --vocab-size
    assert resolved.model.vocab_size == 101  # the tokenizer's
    assert resolved.data.per_split_paths == (["a"], ["b"], [])
    # the parsed configs are as parsed
    assert parsed.training.train_iters is None and parsed.parallel.sequence_parallel
    assert parsed.model.vocab_size == 100 and parsed.data.per_split_paths is None


def _train(rank, world, argv):
    """engine.pretrain.main on this rank, with the configs its set-up received."""
    import engine.pretrain

    received = []
    real_setup = engine.pretrain.setup
    engine.pretrain.setup = lambda cfg, *a, **k: received.append(cfg) or real_setup(cfg, *a, **k)
    code = engine.pretrain.main(argv)
    return code, received[0] == prepare(parse(argv), world)


def test_a_tp2_pp2_dp2_run_trains_on_the_resolved_configs_alone(tmp_path):
    """Preflight and two iterations on 8 ranks: nothing assigns to a config (every config is
    frozen: an assignment would fail the run), and the set-up received exactly what
    `prepare` (resolve, then the checks) returns."""
    log = tmp_path / "log.jsonl"
    argv = SHAPE + [
        "--vocab-size", "64", "--global-batch-size", "4", "--train-iters", "2",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--sequence-parallel", "--use-distributed-optimizer", "--log-interval", "1",
        "--eval-iters", "0", "--log-jsonl", str(log),
    ]  # fmt: skip
    results = run_ranks(_train, 8, argv, timeout=300)
    assert results == [(0, True)] * 8
    iterations = [json.loads(line)["iteration"] for line in log.read_text().splitlines()]
    assert iterations == [1, 2]
