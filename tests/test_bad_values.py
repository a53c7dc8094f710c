"""Values a careless or hostile user gives that used to train on silently or print a
traceback: non-finite and negative numbers on the command line, a learning rate that breaks
the weights, a resume with another tokenizer of the same vocabulary size."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from engine import pretrain
from engine.checkpoint.files import find_latest
from engine.cli import run_main
from engine.data.tokenizers.train_sentencepiece import train_tokenizer
from tests.cli import ROOT, one_line_error, run_python
from tests.test_restarts import SMALL_RUN, interruptible

MOCK = [*SMALL_RUN, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--lr", "inf"], "error: argument --lr: inf is not a finite number; give one such as"),
        (["--clip-grad", "nan"], "error: argument --clip-grad: nan is not a finite number"),
        (["--lr", "1e39"], "error: --lr 1e+39 is beyond any usable learning rate (at most 1e30)"),
        # argparse took -1e-3 for a flag ("expected one argument"): it is a value
        (["--lr", "-1e-3"], "error: need 0 <= --min-lr (0.0) <= --lr (-0.001)"),
        (["--rerun-on-nan", "--fp16"], "error: --rerun-on-nan with --fp16: the loss scaler"),
        (
            ["--rerun-mode", "report_stats"],
            "error: --rerun-mode report_stats (rerunning every step",
        ),
        (["--hang-timeout-seconds", "0"], "error: --hang-timeout-seconds 0: give a positive"),
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


def _tool_refusal(module, argv, capsys) -> str:
    """The one line a tool's main prints for bad input (exit code 2), run in this process."""
    with pytest.raises(SystemExit) as stopped:
        run_main(module.main, argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_the_tools_refuse_counts_and_numbers_they_cannot_use(corpus, tokenizer_model, capsys):
    from tools import compute_budget, curate, plan, preprocess_data, train_tokenizer

    cases = [
        (preprocess_data, ["--workers", "100000"], "error: --workers 100000: this process may use"),
        (preprocess_data, ["--log-interval", "0"], "error: --log-interval 0: need at least 1"),
        (curate, ["--input", corpus["jsonl"], "--output", "x", "--workers", "100000"],
         "error: --workers 100000: this process may use"),
        (train_tokenizer, ["--max-sentence-length", "3"],
         "error: --max-sentence-length 3: give at least 10 bytes"),
        (train_tokenizer, ["--input-sentence-size", "-5"],
         "error: --input-sentence-size -5: give 0 (every line) or a positive number of lines"),
        (train_tokenizer, ["--character-coverage", "2"],
         "error: --character-coverage 2.0: SentencePiece takes 0.98 to 1.0"),
        (compute_budget, ["--parameters", "1e200", "--tokens", "1e200"],
         "error: --parameters/--tokens/--flops: these amounts give flops inf; give amounts"),
        (compute_budget, ["--parameters", "1e-300", "--tokens", "1e-300"],
         "error: --parameters/--tokens/--flops: these amounts cannot be computed"),
        (compute_budget, ["--parameters", "7B", "--tokens", "1T", "--gpus", "8", "--gpu",
                          "h100", "--mfu", "-4e-1"], "error: --mfu -0.4"),
        (plan, ["--intra-node-bandwidth", "nan"],
         "error: argument --intra-node-bandwidth: nan is not a finite number"),
    ]  # fmt: skip
    inputs = {
        preprocess_data: ["--input", corpus["jsonl"], "--output-prefix", "x"]
        + ["--tokenizer-model", tokenizer_model],
        train_tokenizer: ["--input", corpus["jsonl"], "--model-prefix", "x"],
    }
    for module, argv, expected in cases:
        line = _tool_refusal(module, [*inputs.get(module, []), *argv], capsys)
        assert line.startswith(expected), (argv, line)


def test_a_dangling_link_in_an_input_folder_is_named(tmp_path):
    from engine.data.prepare.readers import expand_inputs
    from engine.errors import InputError

    (tmp_path / "a.jsonl").write_text('{"text": "kept"}\n')
    os.symlink(tmp_path / "gone" / "b.jsonl", tmp_path / "b.jsonl")
    with pytest.raises(InputError, match=r"b.jsonl: a link to .*gone/b.jsonl, which does not"):
        expand_inputs(str(tmp_path))
    os.remove(tmp_path / "b.jsonl")
    linked = tmp_path.parent / f"{tmp_path.name}_more"
    linked.mkdir()
    (linked / "c.jsonl").write_text('{"text": "also"}\n')
    os.symlink(linked, tmp_path / "more")  # a linked folder is walked too
    assert [os.path.basename(p) for p in expand_inputs(str(tmp_path))] == ["a.jsonl", "c.jsonl"]


def test_yaml_errors_name_the_line(tmp_path):
    from engine.errors import ConfigError
    from engine.files.structured import read_yaml_or_json

    path = tmp_path / "c.yaml"
    path.write_text("stages:\n  - name: a\n  bad: [\n")
    with pytest.raises(ConfigError, match=r"not valid YAML \(.*, line \d+ column \d+\); fix it"):
        read_yaml_or_json(str(path), "--config")


def test_a_port_in_use_and_a_python_without_torch_are_one_line(tmp_path):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        result = run_python(
            "-m", "engine.launch", "--nnodes", "1", "--nproc-per-node", "1",
            "--master-addr", "127.0.0.1", "--master-port", port, "-m", "engine.pretrain", *MOCK,
        )  # fmt: skip
    assert one_line_error(result).startswith(f"error: port {port} (127.0.0.1:{port}) is already")
    no_torch = str(tmp_path / "python")
    with open(no_torch, "w") as f:
        f.write("#!/bin/sh\nexit 1\n")  # a python that cannot import anything
    os.chmod(no_torch, 0o755)
    script = subprocess.run(
        ["bash", "examples/pretrain_gpt.sh"], capture_output=True, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHON=no_torch),
    )  # fmt: skip
    assert one_line_error(script).startswith(f"error: {no_torch} cannot import torch and the")


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_preprocess_leaves_nothing_behind(stop, corpus, tokenizer_model, tmp_path):
    """kill (SIGTERM) or Ctrl-C (SIGINT to the process group) in the middle of a preprocess:
    the workers stop, the unfinished outputs are removed, and no worker prints a traceback."""
    big = tmp_path / "big.jsonl"
    with open(corpus["jsonl"]) as f:
        text = f.read()
    with open(big, "w") as f:
        for _ in range(40):
            f.write(text)
    out = tmp_path / "out"
    command = [
        *(sys.executable, "tools/preprocess_data.py", "--input", str(big)),
        *("--output-prefix", str(out), "--tokenizer-model", tokenizer_model, "--workers", "2"),
    ]
    process = subprocess.Popen(
        command, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env=dict(os.environ, PYTHONPATH=ROOT), start_new_session=True, preexec_fn=interruptible,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not any(".tmp" in n for n in os.listdir(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the workers are busy
    assert process.poll() is None, "the preprocess ended before it could be stopped"
    os.killpg(process.pid, stop) if stop == signal.SIGINT else process.send_signal(stop)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + stop, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["big.jsonl"]


def test_an_idx_from_another_bin_is_found(tmp_path):
    """Two datasets of the same tokens cut into documents differently: the .idx of one beside
    the .bin of the other is refused (its boundaries miss the EOD tokens); the real pair, and
    data without EOD tokens, pass."""
    import shutil

    import numpy as np

    from engine.data.indexed.dataset import IndexedDataset, IndexedDatasetBuilder
    from engine.data.prepare.token_ids import check_document_boundaries
    from engine.errors import ConfigError

    eod, rng = 3, np.random.default_rng(0)
    documents = [np.append(rng.integers(10, 500, n), eod) for n in rng.integers(20, 80, 100)]
    tokens = np.concatenate(documents)
    cuts = np.cumsum(rng.integers(20, 80, 99))  # the same tokens, other boundaries
    for name, parts in (("right", documents), ("other", np.split(tokens, cuts))):
        with IndexedDatasetBuilder(tmp_path / name, np.uint16) as builder:
            for part in parts:
                builder.add_document(part)
            builder.finalize()
    check_document_boundaries(IndexedDataset(str(tmp_path / "right")), eod)
    shutil.copy(tmp_path / "right.bin", tmp_path / "mixed.bin")
    shutil.copy(tmp_path / "other.idx", tmp_path / "mixed.idx")
    with pytest.raises(ConfigError, match=r"mixed.idx does not describe .*mixed.bin: \d+ of its"):
        check_document_boundaries(IndexedDataset(str(tmp_path / "mixed")), eod)
    check_document_boundaries(IndexedDataset(str(tmp_path / "mixed")), eod=9999)  # no EODs
