"""train_tokenizer.py: fixed special ids, exact round trips of code, no silently dropped lines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, SentencePieceTokenizer
from engine.data.tokenizer_training import _chunks, _Corpus, train_tokenizer
from engine.errors import InputError


def test_special_ids_and_round_trip(tokenizer_model, corpus):
    tok = SentencePieceTokenizer(tokenizer_model)
    assert (tok.unk, tok.bos, tok.eos, tok.pad) == (UNK_ID, BOS_ID, EOS_ID, PAD_ID)
    assert tok.eod == EOS_ID and tok.vocab_size == 2000
    assert [tok.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]
    with open(corpus["jsonl"]) as f:
        text = json.loads(f.readline())["text"]
    assert tok.detokenize(tok.tokenize(text)) == text  # whitespace, newlines, tabs survive
    odd = "\tx  = 'é 漢字 🙂'\n\n    return\n"
    assert tok.detokenize(tok.tokenize(odd)) == odd  # byte fallback covers unseen characters


def test_long_lines_are_split_not_dropped(corpus, tmp_path):
    assert _chunks("ab", 4) == ["ab"]
    assert _chunks("é" * 5, 4) == ["éé", "éé", "é"]  # never inside a UTF-8 character
    with open(corpus["jsonl"]) as f:
        sources = [json.loads(line)["text"] for line in f]
    long_line = " ".join(sources).replace("\n", " ")[:12000]  # one 12,000-byte line
    docs = [{"text": f"x{i} = {i}\n" + long_line} for i in range(60)]
    src = tmp_path / "long.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    # Every byte of every training line reaches SentencePiece, in chunks it will not drop.
    lines = list(_Corpus([str(src)], ["text"], max_sentence_length=1000).lines())
    assert all(len(line.encode()) <= 1000 for line in lines)
    held_out = len(docs) // 50
    assert "".join(lines) == "".join(f"x{i} = {i}" + long_line for i in range(60) if i % 50 != 49)
    report = train_tokenizer(
        [str(src)],
        str(tmp_path / "t"),
        vocab_size=300,
        max_sentence_length=1000,
        byte_fallback=False,
    )
    assert report.lines_split == report.train_documents == len(docs) - held_out


def test_unigram_and_report(corpus, tmp_path):
    report = train_tokenizer(
        [corpus["parquet"]], str(tmp_path / "u"), vocab_size=1500, model_type="unigram"
    )
    assert report.vocab_size == 1500 and report.heldout_documents > 0
    assert 1.0 < report.bytes_per_token < 10.0 and report.tokens_per_word > 1.0
    assert (tmp_path / "u.model").exists() and (tmp_path / "u.vocab").exists()


def test_cli_prints_fertility_and_errors_cleanly(corpus, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "tools/train_tokenizer.py",
            "--input",
            corpus["jsonl"],
            "--model-prefix",
            str(tmp_path / "c"),
            "--vocab-size",
            "1000",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "tokens per word" in result.stdout and "bytes per token" in result.stdout
    result = subprocess.run(
        [
            sys.executable,
            "tools/train_tokenizer.py",
            "--input",
            corpus["jsonl"],
            "--model-prefix",
            str(tmp_path / "big"),
            "--vocab-size",
            "10000000",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "--vocab-size" in result.stderr
    assert not (tmp_path / "big.model").exists()


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="no such tokenizer model"):
        SentencePieceTokenizer(tmp_path / "none.model")
