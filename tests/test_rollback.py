"""Spike recovery (engine/train/rollback.py, engine/train/data_skips.py): a run that rolls back
at a loss spike and skips the data window between the checkpoint and the spike trains exactly
as a run that skips the same window with --skip-data-iterations from the start, on two pipeline
stages; a resume from a checkpoint older than the window skips it again; bad input is one line.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from engine.checkpoint.files import committed_iterations, find_latest, iteration_dir, read_meta
from engine.errors import ConfigError
from engine.train.data_skips import SKIPS_FILE
from tests.cli import one_line_error, run_python
from tests.test_rerun import MOCK
from tests.test_training import base_args, pretrain, records

# the global batch holding training sample 56 (iteration 15's first) is random tokens
BAD_DATA = {"TRIPOD_FAULT_RANDOM_SAMPLES_AT": "56"}


def _args(dataset_prefix, tokenizer_model, save, log, **extra):
    return base_args(
        dataset_prefix, tokenizer_model,
        **{
            "--global-batch-size": "4", "--num-layers": "2", "--train-iters": "20",
            "--pipeline-model-parallel-size": "2", "--hidden-dropout": "0.0",
            "--attention-dropout": "0.0", "--lr": "1e-3", "--lr-warmup-iters": "0",
            "--vocab-size": "4000", "--spike-window": "10", "--spike-zscore": "3",
            "--rollback-on-spike": True, "--rollback-iterations": "5",
            "--save": save, "--save-interval": "4", "--log-jsonl": log, **extra,
        },
    )  # fmt: skip


def _losses(log) -> dict[int, float]:
    """Each iteration's loss as last logged (a rollback logs some iterations twice)."""
    return {r["iteration"]: r["lm_loss"] for r in records(log) if "split" not in r}


def test_rollback_equals_skipping_the_window_from_the_start(
    dataset_prefix, tokenizer_model, tmp_path, capfd
):
    rolled, skipped = tmp_path / "rolled", tmp_path / "skipped"
    pretrain(2, _args(dataset_prefix, tokenizer_model, str(rolled), str(tmp_path / "r.jsonl")),
             BAD_DATA)  # fmt: skip
    out = capfd.readouterr().out
    assert "loss spike at iteration 15" in out and "--rollback-on-spike:" in out
    assert f"rolled back to {iteration_dir(str(rolled), 8)}" in out
    assert "skipping the data of iterations 9 to 15 (training samples 32 to 59)" in out
    # the abandoned stretch's checkpoint is set aside, the run's own go on
    assert os.listdir(rolled / "rolled_back_15") == ["iter_0000012"]
    assert committed_iterations(str(rolled)) == [4, 8, 12, 16, 20]
    [window] = read_meta(iteration_dir(str(rolled), 20))["skipped_data"]
    assert (window["first"], window["last"], window["samples"]) == (9, 15, [32, 60])
    assert json.loads((rolled / SKIPS_FILE).read_text()) == [window]

    by_hand = {"--skip-data-iterations": "9:15"}
    pretrain(2, _args(dataset_prefix, tokenizer_model, str(skipped), str(tmp_path / "s.jsonl"),
                      **by_hand), BAD_DATA)  # fmt: skip
    out = capfd.readouterr().out
    assert "loss spike" not in out, out[-2000:]
    assert "iteration 9: skipping the data of iterations 9 to 15" in out
    reference = _losses(tmp_path / "s.jsonl")
    assert _losses(tmp_path / "r.jsonl") == reference  # exactly, every iteration

    # a resume from before the window (as after a failure right after the rollback) skips it
    again = tmp_path / "again"
    shutil.copytree(rolled, again)
    for iteration in (12, 16, 20):
        shutil.rmtree(iteration_dir(str(again), iteration))
    (again / "latest_checkpointed_iteration.txt").write_text("8\n")
    pretrain(2, _args(dataset_prefix, tokenizer_model, str(again), str(tmp_path / "a.jsonl"),
                      **{"--load": str(again)}))  # fmt: skip
    out = capfd.readouterr().out
    assert "iteration 9: skipping the data of iterations 9 to 15" in out
    resumed = _losses(tmp_path / "a.jsonl")
    assert resumed == {i: reference[i] for i in range(9, 21)}
    assert find_latest(str(again)) == 20

    # a range the resumed checkpoint is past and did not skip: its data was trained on
    late = {"--load": str(skipped), "--skip-data-iterations": "3:5"}
    late["--pipeline-model-parallel-size"] = "1"
    with pytest.raises(Exception, match="resumes at iteration 20, past its start"):
        pretrain(1, _args(dataset_prefix, tokenizer_model, str(tmp_path / "x"),
                          str(tmp_path / "x.jsonl"), **late))  # fmt: skip


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rollback-on-spike"], "--rollback-on-spike reloads an earlier checkpoint of --save"),
        (["--skip-data-iterations", "15:30"], "--skip-data-iterations 15:30: beyond the run's"),
        (["--skip-data-iterations", "9-12"], "--skip-data-iterations 9-12: give FIRST:LAST"),
        (["--skip-data-iterations", "12:9"], "--skip-data-iterations 12:9: give 1 <= FIRST"),
    ],
)
def test_bad_rollback_and_skip_flags_are_one_line(flags, message):
    from engine.pretrain import parse
    from engine.train.preflight import prepare

    with pytest.raises(ConfigError, match=message):
        prepare(parse([*MOCK, "--train-iters", "20", *flags]), 1)


def test_a_skip_outside_the_run_exits_2_through_the_command_line():
    result = run_python(
        "-m", "engine.pretrain", *MOCK, "--train-iters", "20", "--skip-data-iterations", "15:30"
    )  # fmt: skip
    assert "beyond the run's 20 iterations" in one_line_error(result)
