"""The README's command with a mistake: one line and exit code 2 through
examples/pretrain_gpt.sh (engine.launch checks the whole configuration before any rank
starts; an error found inside the ranks is printed once), and the token ids of the data are
checked against the vocabulary at start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from engine.checkpoint.files import iteration_dir
from engine.data.indexed.dataset import IndexedDataset, IndexedDatasetBuilder
from engine.data.prepare.token_ids import check_token_ids, token_id_range
from engine.errors import ConfigError, UserError
from tests.cli import CPU_ONLY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = [
    *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2"),
    *("--global-batch-size", "4", "--train-iters", "3", "--lr-warmup-iters", "1"),
    *("--eval-iters", "1", "--make-vocab-size-divisible-by", "16", "--split", "90,10,0"),
]


@pytest.fixture(scope="module")
def data_folder(dataset_prefix, tokenizer_model, tmp_path_factory) -> str:
    """What examples/pretrain_gpt.sh expects under $DATA, plus a dataset whose documents end
    with GPT-2's EOD id 50256, as Megatron-LM's legacy GPT-2 tokenizer writes them."""
    folder = tmp_path_factory.mktemp("launch_data")
    for suffix in (".bin", ".idx"):
        os.symlink(dataset_prefix + suffix, folder / f"stdlib_text_document{suffix}")
    os.symlink(tokenizer_model, folder / "tokenizer.model")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(folder / "legacy_text_document", np.uint16) as builder:
        for _ in range(200):
            builder.add_document(np.append(rng.integers(0, 2000, 60), 50256))
        builder.finalize()
    # documents of the tokenizer's ids without its EOD at their ends (no --append-eod)
    with IndexedDatasetBuilder(folder / "no_eod_text_document", np.uint16) as builder:
        for _ in range(200):
            builder.add_document(rng.integers(10, 2000, 60))
        builder.finalize()
    return str(folder)


def launch(
    data_folder: str, *args: str, timeout: int = 240, script: str = "pretrain_gpt.sh"
) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        **CPU_ONLY,
        NPROC_PER_NODE="2",
        DATA=data_folder,
        PYTHON=sys.executable,
    )
    env.pop("MASTER_PORT", None)  # torchrun's --standalone picks a free port
    return subprocess.run(
        ["bash", f"examples/{script}", *SMALL, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )


def test_the_mixtral_example_trains_a_mixture_of_experts(data_folder, tmp_path):
    log = tmp_path / "log.jsonl"
    result = launch(
        data_folder, "--log-jsonl", str(log), "--log-interval", "1", script="pretrain_mixtral.sh"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = [json.loads(line) for line in log.read_text().splitlines()]
    found = [r for r in found if "split" not in r]
    assert [r["iteration"] for r in found] == [1, 2, 3]
    assert all(0.5 < r["load_balancing_loss"] < 2.0 for r in found)
    assert "load_balancing_loss" in result.stdout  # on the console line


def test_the_deepseek_v3_example_trains_with_its_pipeline_layout(data_folder, tmp_path):
    """examples/pretrain_deepseek_v3.sh: MLA, MoE after a dense layer, one MTP depth, and
    the layout "Ett|tt|t|tmL" over 2 ranks x 2 virtual stages."""
    log = tmp_path / "log.jsonl"
    env = dict(os.environ, **CPU_ONLY, NPROC_PER_NODE="2", DATA=data_folder)
    env |= {"PYTHON": sys.executable}
    env.pop("MASTER_PORT", None)
    small = [
        *("--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2"),
        *("--global-batch-size", "4", "--train-iters", "3", "--lr-warmup-iters", "1"),
        *("--eval-iters", "1", "--make-vocab-size-divisible-by", "16", "--split", "90,10,0"),
        *("--log-jsonl", str(log), "--log-interval", "1"),
    ]
    result = subprocess.run(
        ["bash", "examples/pretrain_deepseek_v3.sh", *small],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = [json.loads(line) for line in log.read_text().splitlines()]
    found = [r for r in found if "split" not in r]
    assert [r["iteration"] for r in found] == [1, 2, 3]
    assert all(r["mtp_1_loss"] > 0 and r["seq_load_balancing_loss"] > 0 for r in found)
    # rank 0: the embedding and layers 0-1, then layer 4; rank 1: layers 2-3, then 5 and MTP
    assert "(pipeline rank 0): layers 0-1: sdpa-causal; 4: sdpa-causal" in result.stdout
    assert "(pipeline rank 1): layers 2-3: sdpa-causal; 5-6: sdpa-causal" in result.stdout


def test_configuration_errors_are_one_line_before_any_rank(data_folder, tmp_path):
    """One mistake of each kind through the launcher (a flag, the layout, the data, an output
    path); the other checks the launcher runs are the same function, called in this process
    below (a launch costs seconds)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    legacy = os.path.join(data_folder, "legacy_text_document")
    cases = [
        (["--hidden-sise", "64"], "unrecognized arguments: --hidden-sise"),
        (["--tensor-model-parallel-size", "4"], "world size 2 is not divisible"),
        (["--data-path", legacy], "holds token id 50256, but the tokenizer"),
        (["--save", str(a_file / "ckpt")], "--save: "),
        (
            ["--data-path", os.path.join(data_folder, "no_eod_text_document"), "--eod-mask-loss"],
            "--eod-mask-loss: " + os.path.join(data_folder, "no_eod_text_document") + " has no "
            "end-of-document token",
        ),
    ]
    for extra, message in cases:
        result = launch(data_folder, *extra)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, (extra, result.stderr[-3000:])
        assert lines[0].startswith("error: ") and message in lines[0], (extra, lines[0])
        assert "ops:" not in result.stdout, extra  # no rank started


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--split", "0,1,0"], "--split 0,1,0 gives the train split nothing"),
        (["--data-path", "LEGACY", "--tensor-model-parallel-size", "2"],
         "has a vocabulary of 2000 (ids 0..1999)"),
        (["--data-path", "NOTHING"], "nothing.idx: no such file"),
        (["--fim-data"], "--fim-prefix-token '<fim_prefix>' is not a token of the tokenizer"),
        (["--fim-data", "--fim-rate", "1.5"], "--fim-rate 1.5: a probability, between 0 and 1"),
        (["--fim-data", "--fim-split-sample", "x"], "--fim-split-sample needs --fim-fragment"),
    ],
)  # fmt: skip
def test_the_launchers_checks_find_each_mistake(data_folder, tmp_path, extra, message):
    """What engine.launch checks before any rank (engine/train/preflight.py's prepare), with
    the flags examples/pretrain_gpt.sh passes, for a world of 2."""
    from engine.pretrain import parse
    from engine.train.preflight import prepare

    places = {"LEGACY": os.path.join(data_folder, "legacy_text_document"),
              "NOTHING": str(tmp_path / "nothing")}  # fmt: skip
    extra = [places.get(arg, arg) for arg in extra]
    data = [] if "--data-path" in extra else [
        "--data-path", os.path.join(data_folder, "stdlib_text_document")]  # fmt: skip
    tokenizer = ["--tokenizer-type", "SentencePieceTokenizer",
                 "--tokenizer-model", os.path.join(data_folder, "tokenizer.model")]  # fmt: skip
    argv = [*data, *tokenizer, "--lr", "1e-3", *SMALL, *extra]
    with pytest.raises(UserError) as found:
        prepare(parse(argv), 2)
    assert message in str(found.value) and "\n" not in str(found.value)


def test_an_unknown_precision_is_one_line(data_folder):
    env = dict(os.environ, **CPU_ONLY, NPROC_PER_NODE="2", DATA=data_folder, PRECISION="fp64")
    result = subprocess.run(
        ["bash", "examples/pretrain_gpt.sh", *SMALL],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "PRECISION=fp64: use bf16 or fp32 (or pass --fp16)"
    ]


def test_an_error_inside_the_ranks_is_printed_once(data_folder, small_checkpoint, tmp_path):
    """A flipped byte keeps the file's size, so only the ranks' checksums find it."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(small_checkpoint, ckpt)
    shard = os.path.join(iteration_dir(ckpt, 2), "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(1000)
        value = f.read(1)[0]
        f.seek(1000)
        f.write(bytes([value ^ 1]))
    result = launch(data_folder, "--load", ckpt)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0] == (
        f"error: {shard}: checksum mismatch, the file is damaged; load an earlier checkpoint, "
        "or pass --no-verify to load it anyway"
    )


def test_token_id_range_is_cached_and_refreshed(data_folder, tmp_path, monkeypatch):
    """One scan per dataset version: the second start reads the cache, a rewritten dataset
    (new size and time) is scanned again."""
    from engine.data.prepare import token_ids

    scans = []
    real_scan = token_ids._scan
    monkeypatch.setattr(token_ids, "_scan", lambda d: scans.append(d.prefix) or real_scan(d))
    cache = str(tmp_path / "cache")
    prefix = str(tmp_path / "copy_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copy(os.path.join(data_folder, "legacy_text_document") + suffix, prefix + suffix)
    for _ in range(2):
        dataset = IndexedDataset(prefix)
        assert token_id_range(dataset, cache) == (0, 50256)
        dataset.close()
    assert len(scans) == 1
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        builder.add_document([5, 6, 7])
        builder.finalize()
    dataset = IndexedDataset(prefix)
    assert token_id_range(dataset, cache) == (5, 7)
    dataset.close()
    assert len(scans) == 2
    dataset = IndexedDataset(prefix)
    check_token_ids(dataset, 8, "--vocab-size 8", cache)
    with pytest.raises(ConfigError, match="holds token id 7, but --vocab-size 7 has a vocab"):
        check_token_ids(dataset, 7, "--vocab-size 7", cache)
    check_token_ids(dataset, 70000, "--vocab-size 70000", cache)  # uint16: nothing to scan
    dataset.close()
    assert len(scans) == 2
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        builder.add_document([5, -3, 7])
        builder.finalize()
    dataset = IndexedDataset(prefix)
    with pytest.raises(ConfigError, match="negative token id -3"):
        check_token_ids(dataset, 70000, "--vocab-size 70000", cache)
    dataset.close()
