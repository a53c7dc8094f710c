"""train_tokenizer.py: fixed special ids, exact round trips of code, no silently dropped lines."""

from __future__ import annotations

import gzip
import json
import re

import pytest

from engine.data.tokenizers.sentencepiece import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    SentencePieceTokenizer,
)
from engine.data.tokenizers.train_sentencepiece import _chunks, _Corpus, train_tokenizer
from engine.errors import InputError
from tests.cli import one_line_error, run_tool


def _tool(*args: str):
    return run_tool("train_tokenizer.py", *args)


def _small_input(corpus, path, documents=3, before: bytes = b"") -> str:
    """A few documents of the corpus as JSONL (after `before`); trains in well under a second."""
    with open(corpus["jsonl"], "rb") as f:
        path.write_bytes(before + b"".join(f.readlines()[:documents]))
    return str(path)


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


def test_cli_prints_fertility(corpus, tmp_path):
    result = _tool(
        "--input", corpus["jsonl"], "--model-prefix", str(tmp_path / "c"), "--vocab-size", "1000"
    )
    assert result.returncode == 0, result.stderr
    assert "tokens per word" in result.stdout and "bytes per token" in result.stdout


BAD_LINES = [
    (b'{"text": "a = 1"}\n{"text": \n', "bad.jsonl:line 2: malformed JSON"),
    (b'{"text": "a = 1"}\n{"text": "caf\xe9"}\n', "bad.jsonl:line 2: bytes that are not UTF-8"),
    (b'{"text": "a = 1"}\n{"body": "x"}\n', "bad.jsonl:line 2: no key 'text' (keys: body)"),
]


@pytest.mark.parametrize("bad, message", BAD_LINES)
def test_cli_bad_line_is_one_line_or_skipped(corpus, tmp_path, bad, message):
    src = _small_input(corpus, tmp_path / "bad.jsonl", before=bad)
    args = ["--input", src, "--model-prefix", str(tmp_path / "t"), "--vocab-size", "400"]
    line = one_line_error(_tool(*args))
    assert message in line and "--vocab-size" not in line
    assert not list(tmp_path.glob("t.*"))
    result = _tool(*args, "--skip-bad-records")
    assert result.returncode == 0, result.stderr
    assert "bad records skipped: 1)" in result.stdout and message in result.stderr


@pytest.mark.parametrize(
    "vocab, flags, minimum",
    [("0", [], 261), ("3", [], 261), ("261", [], 261), ("5", ["--no-byte-fallback"], 5)],
)
def test_cli_vocab_size_not_above_the_reserved_pieces(corpus, tmp_path, vocab, flags, minimum):
    src = _small_input(corpus, tmp_path / "in.jsonl")
    args = ["--input", src, "--model-prefix", str(tmp_path / "t"), "--vocab-size", vocab, *flags]
    line = one_line_error(_tool(*args))
    assert "raise --vocab-size" in line and f"more than the {minimum} reserved" in line
    line = one_line_error(_tool(*args, "--user-defined-symbols", "<a>", "<b>"))
    assert f"more than the {minimum + 2} reserved" in line


def test_cli_vocab_size_against_what_the_input_allows(corpus, tmp_path):
    src = _small_input(corpus, tmp_path / "in.jsonl")
    args = ["--input", src, "--model-prefix", str(tmp_path / "t")]
    line = one_line_error(_tool(*args, "--vocab-size", "10000000"))
    at_most = re.search(r"lower --vocab-size to at most (\d+)", line)
    assert at_most and "or give more input" in line, line
    assert _tool(*args, "--vocab-size", at_most.group(1)).returncode == 0
    # Above the reserved pieces, but not enough for every character of the input as well.
    line = one_line_error(_tool(*args, "--vocab-size", "270"))
    assert re.search(r"raise --vocab-size to at least \d+", line), line
    assert not list(tmp_path.glob("t.*.tmp*"))


@pytest.mark.parametrize("content", [b"", b'{"text": ""}\n{"text": "\\n\\n"}\n'])
def test_cli_input_without_text(tmp_path, content):
    (tmp_path / "e.jsonl").write_bytes(content)
    result = _tool("--input", str(tmp_path / "e.jsonl"), "--model-prefix", str(tmp_path / "t"))
    line = one_line_error(result)
    assert "e.jsonl: no text to train on" in line


def test_cli_truncated_input_is_one_line(corpus, tmp_path):
    with open(corpus["jsonl"], "rb") as f:
        packed = gzip.compress(b"".join(f.readlines()[:3]))
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    result = _tool("--input", str(tmp_path / "cut.jsonl.gz"), "--model-prefix", str(tmp_path / "t"))
    assert "cut.jsonl.gz: truncated or corrupt gzip data" in one_line_error(result)


def test_cli_unwritable_model_prefix_is_found_before_training(corpus, tmp_path):
    src = _small_input(corpus, tmp_path / "in.jsonl", before=b'{"text": \n')
    line = one_line_error(_tool("--input", src, "--model-prefix", f"{src}/t"))
    assert f"{src}/t.model: a file stands where a folder is needed" in line


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(
        InputError, match="no such file .the SentencePiece model.; fix the path, or train one"
    ):
        SentencePieceTokenizer(tmp_path / "none.model")
