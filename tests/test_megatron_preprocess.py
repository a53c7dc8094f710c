"""Megatron-LM's preprocessing with a Hugging Face tokenizer (its tokenizer from megatron-core and
its IndexedDatasetBuilder, as its tools/preprocess_data.py runs them) and ours write the same
bytes; its data trains here unchanged; its other preprocess flags are accepted or refused."""

from __future__ import annotations

import json
import os

import pytest

from tests.cli import one_line_error, run_tool
from tests.test_training import base_args, pretrain
from tests.tokenizer_files import make_bos_folder, make_hf_folder

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def hf_folder(corpus, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("megatron-hf")
    return make_bos_folder(make_hf_folder(corpus["jsonl"], str(root / "hf")), str(root / "bos"))


def megatron_preprocess(jsonl: str, hf_folder: str, prefix: str) -> None:
    """What Megatron-LM's tools/preprocess_data.py does per document with --append-eod and
    --tokenizer-type HuggingFaceTokenizer, with megatron-core's own tokenizer and writer."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from megatron.core.tokenizers import MegatronTokenizer

    tokenizer = MegatronTokenizer.from_pretrained(
        tokenizer_path=hf_folder,
        metadata_path={"library": "huggingface"},
        include_special_tokens=True,  # Megatron-LM's default now
    )
    builder = IndexedDatasetBuilder(
        f"{prefix}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size)
    )
    with open(jsonl) as f:
        for line in f:
            ids = tokenizer.tokenize(json.loads(line)["text"])
            if ids:
                ids.append(tokenizer.eod)
            builder.add_document(ids, [len(ids)] if ids else [])
    builder.finalize(f"{prefix}.idx")


def test_same_bytes_as_megatron_and_its_data_trains(corpus, hf_folder, tmp_path):
    theirs = str(tmp_path / "theirs_text_document")
    megatron_preprocess(corpus["jsonl"], hf_folder, theirs)
    result = run_tool(
        "preprocess_data.py",
        *("--input", corpus["jsonl"], "--output-prefix", str(tmp_path / "ours")),
        *("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_folder),
        *("--append-eod", "--workers", "2", "--partitions", "2", "--keep-newlines"),
        *("--keep-sequential-samples", "--lang", "english", "--no-progress"),
    )
    assert result.returncode == 0, result.stderr
    for suffix in (".bin", ".idx"):
        with (
            open(theirs + suffix, "rb") as a,
            open(tmp_path / f"ours_text_document{suffix}", "rb") as b,
        ):
            assert a.read() == b.read(), suffix
    log = tmp_path / "log.jsonl"
    args = base_args(
        theirs,
        hf_folder,
        **{
            "--tokenizer-type": "HuggingFaceTokenizer",
            "--train-iters": "3",
            "--log-jsonl": str(log),
        },
    )
    pretrain(1, args)
    losses = [json.loads(line)["lm_loss"] for line in log.read_text().splitlines()]
    assert len(losses) >= 3 and all(loss == loss for loss in losses)


def test_sentence_splitting_is_refused_in_one_line(corpus, hf_folder, tmp_path):
    result = run_tool(
        "preprocess_data.py",
        *("--input", corpus["jsonl"], "--output-prefix", str(tmp_path / "out")),
        *("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_folder),
        "--split-sentences",
    )
    assert result.returncode == 2
    assert one_line_error(result).startswith("error: --split-sentences is not supported")
    assert not list(tmp_path.iterdir())
