"""Every checkpoint records the run that wrote it (engine/train/run_record.py): the configuration
as resolved, the flags given, the data files and the code; tools/diff_runs.py prints what
differs between two runs."""

from __future__ import annotations

from engine.checkpoint.files import find_latest, iteration_dir, read_meta
from tests.cli import run_tool
from tests.distributed import run_ranks
from tests.test_rerun import _train
from tests.test_restarts import SMALL_RUN


def test_checkpoints_record_the_run_and_runs_are_compared(
    dataset_prefix, tokenizer_model, tmp_path
):
    data = ["--data-path", dataset_prefix, "--tokenizer-type", "SentencePieceTokenizer"]
    data += ["--tokenizer-model", tokenizer_model, "--train-iters", "2"]
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    run_ranks(_train, 1, [*SMALL_RUN, *data, "--save", first], {})
    run_ranks(_train, 1, [*SMALL_RUN, *data, "--save", second, "--lr", "1e-3", "--seed", "7"], {})

    record = read_meta(iteration_dir(first, find_latest(first)))["run"]
    assert record["configuration"]["model"]["hidden_size"] == 32
    assert "--hidden-size" in record["configuration"]["given"]
    [(prefix, files)] = record["data_files"].items()
    assert prefix.endswith("data_text_document") and len(files["idx_xxh3"]) == 16
    assert files["bin_bytes"] > 0 and record["code"]["package"]
    assert len(record["code"].get("commit", "x" * 40).removesuffix("+changes")) == 40

    result = run_tool("diff_runs.py", first, second)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "configuration.optimizer.lr: 0.0003 | 0.001" in lines
    assert "configuration.training.seed: 1234 | 7" in lines
    assert any(line.startswith("configuration.checkpointing.save: ") for line in lines)
    assert run_tool("diff_runs.py", first, first).stdout.startswith("the two runs have the same")
