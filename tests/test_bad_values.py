"""Values a careless or hostile user gives that used to train on silently or print a
traceback: non-finite and negative numbers on the command line, a learning rate that breaks
the weights, a resume with another tokenizer of the same vocabulary size."""

from __future__ import annotations

import os

import pytest

from engine import pretrain
from engine.checkpoint.files import find_latest
from engine.cli import run_main
from engine.data.tokenizers.train_sentencepiece import train_tokenizer
from tests.cli import one_line_error, run_python
from tests.test_restarts import SMALL_RUN

MOCK = [*SMALL_RUN, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--lr", "inf"], "error: argument --lr: inf is not a finite number; give one such as"),
        (["--clip-grad", "nan"], "error: argument --clip-grad: nan is not a finite number"),
        (["--lr", "1e39"], "error: --lr 1e+39 is beyond any usable learning rate (at most 1e30)"),
        # argparse took -1e-3 for a flag ("expected one argument"): it is a value
        (["--lr", "-1e-3"], "error: need 0 <= --min-lr (0.0) <= --lr (-0.001)"),
    ],
)
def test_bad_numbers_are_one_line(flags, expected, capsys):
    with pytest.raises(SystemExit) as stopped:
        run_main(pretrain.main, [*MOCK, *flags])  # refused before any process group
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_weights_gone_non_finite_stop_the_run_before_a_save(tmp_path):
    """A weight turned NaN after the update of iteration 3: the save of iteration 4 is not
    written, the run stops in one line naming the checkpoint kept, exit code 1."""
    ckpt = str(tmp_path / "ckpt")
    result = run_python(
        "-m", "engine.pretrain", *MOCK, "--save", ckpt, "--save-interval", "2",
        "--log-interval", "5",
        env={"TRIPOD_FAULT_PERTURB_WEIGHT_AT": "0:3", "TRIPOD_FAULT_PERTURB_BY": "nan"},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert find_latest(ckpt) == 2
    assert not os.path.exists(os.path.join(ckpt, "iter_0000004"))
    assert (
        "stopping at iteration 4: the weights hold NaN or Inf after the update (found before "
        "saving); checkpoint 2 is the latest; lower --lr (or give --clip-grad) and resume from it"
    ) in result.stdout
    assert "Traceback" not in result.stderr


def test_a_resume_with_another_tokenizer_is_refused(
    dataset_prefix, tokenizer_model, tmp_path, corpus
):
    """Two tokenizers with the same vocabulary size that encode text differently: a resume
    with the other one is refused unless --finetune."""
    ckpt = str(tmp_path / "ckpt")
    data = [*SMALL_RUN, "--data-path", dataset_prefix, "--tokenizer-type", "SentencePieceTokenizer"]
    first = run_python(
        "-m", "engine.pretrain", *data, "--tokenizer-model", tokenizer_model,
        "--save", ckpt, "--train-iters", "2",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    other = str(tmp_path / "unigram")  # the same corpus and size, another model type
    train_tokenizer([corpus["jsonl"]], other, vocab_size=2000, model_type="unigram")
    other += ".model"
    resume = [*data, "--tokenizer-model", other, "--load", ckpt, "--train-iters", "4"]
    assert one_line_error(run_python("-m", "engine.pretrain", *resume)) == (
        f"error: --load {ckpt}/iter_0000002 was trained with another tokenizer than the one the "
        "tokenizer flags name (they encode the same text differently); give the run's "
        "tokenizer, or --finetune to start a new run from its weights"
    )
    finetune = run_python("-m", "engine.pretrain", *resume, "--finetune")
    assert finetune.returncode == 0, finetune.stderr[-3000:]
