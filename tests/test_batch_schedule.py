"""The global batch over a run: --rampup-batch-size against megatron-core 0.16.1's own ramp-up
calculator and learning-rate scheduler (installed for the tests), --step-batch-size-schedule
against worked examples (megatron-core 0.16.1 has no step schedule; Megatron-LM added it
later), and both through the real training loop, resumed mid-ramp."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from engine.config.batch_schedule import BatchSchedule, parse_step_schedule
from engine.config.optimizer import OptimizerConfig
from engine.config.training import TrainingConfig
from engine.errors import ConfigError
from engine.optim.lr_schedule import LRScheduler
from engine.pretrain import parse
from engine.train.preflight import prepare
from tests.test_training import base_args, pretrain, records

# (start, increment, ramp-up samples, global batch, micro-batch x data-parallel size)
RAMPS = [(2, 2, 24, 8, 2), (16, 16, 300, 128, 16), (4, 4, 7, 16, 4), (3, 6, 1, 15, 3)]


def megatron_calculator(start, increment, samples, final, unit):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.num_microbatches_calculator import (
            RampupBatchsizeNumMicroBatchesCalculator,
        )

    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=final,
        micro_batch_size=unit,
        data_parallel_size=1,
        decrease_batch_size_if_needed=False,
        rank=1,  # not 0: no logging
        start_global_batch_size=start,
        batch_size_increment=increment,
        ramup_samples=samples,
    )


def ramp(start, increment, samples, final, unit) -> BatchSchedule:
    train = TrainingConfig(
        micro_batch_size=unit,
        global_batch_size=final,
        rampup_batch_size=[start, increment, samples],
    )
    return train.batch_schedule(dp=1, seq_length=64)


@pytest.mark.parametrize("case", RAMPS, ids=str)
def test_rampup_batch_equals_megatron_core(case):
    ours, theirs = ramp(*case), megatron_calculator(*case)
    for consumed in range(case[2] + 3 * case[3]):
        theirs.update(consumed, consistency_check=True)
        assert ours.at(consumed) == theirs.get_current_global_batch_size(), consumed


@pytest.mark.parametrize("train_samples", [1, 30, 31, 100, 1000])
@pytest.mark.parametrize("case", RAMPS, ids=str)
def test_rampup_iterations_equal_megatron(case, train_samples):
    """Megatron-LM's update_train_iters (megatron.training, not installed: its loop is restated
    here, driven by megatron-core's calculator): the ramp's steps while at most the ramp-up
    samples and at most --train-samples are consumed, then whole final batches."""
    theirs = megatron_calculator(*case)
    consumed = iterations = 0
    while consumed <= case[2] and consumed <= train_samples:
        theirs.update(consumed, consistency_check=False)
        consumed += theirs.get_current_global_batch_size()
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // case[3]
    assert ramp(*case).iterations_for_samples(train_samples) == iterations


def test_learning_rates_through_a_ramp_equal_megatron_core():
    """megatron-core's scheduler steps by the current global batch after each update; ours is
    advanced by the batch our schedule gives; by samples, warm-up and decay inside the ramp."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    case, train_samples = (16, 16, 300, 128, 16), 2000
    for style in ("linear", "cosine", "inverse-square-root", "WSD"):
        cfg = OptimizerConfig(
            lr=1e-3,
            min_lr=1e-5,
            lr_decay_style=style,
            lr_warmup_samples=100,
            lr_decay_samples=1500,
            lr_wsd_decay_samples=400 if style == "WSD" else None,
        )
        schedule = ramp(*case)
        iters = schedule.iterations_for_samples(train_samples)
        ours = LRScheduler(cfg, iters, case[3], train_samples)
        param = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([param], lr=cfg.lr)
        theirs = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0,
            max_lr=cfg.lr,
            min_lr=cfg.min_lr,
            lr_warmup_steps=100,
            lr_decay_steps=1500,
            lr_decay_style=style,
            start_wd=0.0,
            end_wd=0.0,
            wd_incr_steps=train_samples,
            wd_incr_style="constant",
            wsd_decay_steps=cfg.lr_wsd_decay_samples,
            lr_wsd_decay_style=cfg.lr_wsd_decay_style,
        )
        calculator = megatron_calculator(*case)
        consumed = 0
        for _ in range(iters):
            calculator.update(consumed, consistency_check=True)
            batch = calculator.get_current_global_batch_size()
            assert ours.lr == optimizer.param_groups[0]["lr"], (style, consumed)
            theirs.step(increment=batch)
            ours.advance(schedule.at(consumed))
            consumed += batch


def test_step_schedule_in_tokens():
    """GPT-3's schedule from Megatron-LM's example: thresholds in tokens, divided by the
    sequence length into samples; each step's batch is the entry reached by the samples
    consumed before it."""
    steps = parse_step_schedule("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048)
    assert steps[:3] == ((0, 16), (2_400_000_000 // 2048, 320), (4_800_000_000 // 2048, 624))
    schedule = BatchSchedule(8, steps=parse_step_schedule("0:2,96:4 160:8", 8))
    assert [schedule.at(c) for c in (0, 11, 12, 19, 20, 10**6)] == [2, 2, 4, 4, 8, 8]
    # steps until --train-samples is reached, the last may pass it: 6 x 2, 2 x 4, then 8s
    assert schedule.iterations_for_samples(12) == 6
    assert schedule.iterations_for_samples(13) == 7
    assert schedule.iterations_for_samples(36) == 10
    assert schedule.iterations_for_samples(37) == 11
    assert schedule.sizes(9) == ({2, 4, 8}, 12 + 8 + 8)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--rampup-batch-size", "2", "2", "24"],
            "--rampup-batch-size needs a run counted in samples",
        ),
        (
            ["--step-batch-size-schedule", "0:4 256:8", "--rampup-batch-size", "2", "2", "8"],
            "give one",
        ),
        (["--step-batch-size-schedule", "0:4 256:16"], "differs from the last batch"),
        (["--step-batch-size-schedule", "64:8"], "must start at 0 tokens"),
        (["--step-batch-size-schedule", "0:4 8:6 256:8"], "two entries start at sample 0"),
        (["--step-batch-size-schedule", "0:4 x:8"], "'X' is not a number"),
        (["--step-batch-size-schedule", "0:3 256:8"], "global batch 3 is not divisible"),
    ],
)
def test_batch_schedule_errors_are_one_line(extra, message):
    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "50", "--mock-data", "--vocab-size", "64",
        "--tokenizer-type", "NullTokenizer",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match=message) as err:
        prepare(parse(argv + extra), 1)
    assert "\n" not in str(err.value)


def _run(dataset_prefix, tokenizer_model, tmp_path, name, **overrides):
    log = str(tmp_path / f"{name}.jsonl")
    args = base_args(
        dataset_prefix,
        tokenizer_model,
        **{
            "--micro-batch-size": "1",
            "--train-iters": None,
            "--lr-warmup-iters": None,
            "--train-samples": "60",
            "--lr-warmup-samples": "6",
            "--lr-decay-style": "cosine",
            "--rampup-batch-size": ["2", "2", "24"],
            "--log-jsonl": log,
            **overrides,
        },
    )
    pretrain(2, args)
    return [r for r in records(log) if "split" not in r]


def test_a_ramped_run_trains_with_megatron_batches_and_learning_rates(
    dataset_prefix, tokenizer_model, tmp_path
):
    """Two ranks, --rampup-batch-size 2 2 24 to a global batch of 8 over --train-samples 60:
    every iteration's batch, samples consumed and learning rate are megatron-core's; a run
    stopped mid-ramp and resumed logs the same losses and learning rates."""
    found = _run(dataset_prefix, tokenizer_model, tmp_path, "whole")
    case = (2, 2, 24, 8, 2)
    calculator = megatron_calculator(*case)
    batches, consumed = [], 0
    while len(batches) < len(found):
        calculator.update(consumed, consistency_check=True)
        batches.append(calculator.get_current_global_batch_size())
        consumed += batches[-1]
    assert [r["batch_size"] for r in found] == batches
    assert batches[:4] == [2, 2, 2, 2] and batches[-1] == 8
    assert [r["consumed_samples"] for r in found][-1] == sum(batches)
    assert len(found) == ramp(*case).iterations_for_samples(60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    # megatron-core's scheduler as Megatron-LM's training.py builds it for a run by samples
    # (warm-up and decay in samples, the decay over --train-samples), stepped by each batch
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    theirs = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=3e-3,
        min_lr=3e-4,
        lr_warmup_steps=6,
        lr_decay_steps=60,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=60,
        wd_incr_style="constant",
    )
    expected = []
    for batch in batches:
        expected.append(optimizer.param_groups[0]["lr"])
        theirs.step(increment=batch)
    assert [r["lr"] for r in found] == pytest.approx(expected, rel=1e-12, abs=0)

    ckpt = str(tmp_path / "ckpt")
    first = _run(
        dataset_prefix,
        tokenizer_model,
        tmp_path,
        "first",
        **{"--save": ckpt, "--exit-interval": "5"},
    )
    assert len(first) == 5 and os.path.isdir(ckpt)
    rest = _run(dataset_prefix, tokenizer_model, tmp_path, "rest", **{"--load": ckpt})
    resumed = first + rest
    assert [r["iteration"] for r in resumed] == [r["iteration"] for r in found]
    for key in ("lm_loss", "lr", "batch_size", "consumed_samples"):
        assert [r[key] for r in resumed] == [r[key] for r in found], key


def test_a_step_schedule_run_trains_by_iterations(dataset_prefix, tokenizer_model, tmp_path):
    """--step-batch-size-schedule with --train-iters and the matching --global-batch-size, as
    Megatron-LM's GPT-3 example passes them: thresholds in tokens (32 per sample here)."""
    found = _run(
        dataset_prefix,
        tokenizer_model,
        tmp_path,
        "steps",
        **{
            "--rampup-batch-size": None,
            "--train-samples": None,
            "--lr-warmup-samples": None,
            "--train-iters": "8",
            "--lr-warmup-iters": "1",
            "--step-batch-size-schedule": "0:2 192:4 320:8",
        },
    )
    # 6 samples before 192 tokens at 2 a step, then 4 until 10 samples, then 8
    assert [r["batch_size"] for r in found] == [2, 2, 2, 4, 8, 8, 8, 8]
    assert found[-1]["consumed_samples"] == 6 + 4 + 32
