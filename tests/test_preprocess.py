"""preprocess_data.py: every input format, identical output for any worker count, and bad input
that stops with a one-line error naming file and line/row, leaving nothing behind."""

from __future__ import annotations

import collections
import functools
import gzip
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from engine.data.indexed.dataset import IndexedDataset
from engine.data.prepare.preprocess import encode_batch, preprocess
from engine.data.tokenizers.sentencepiece import SentencePieceTokenizer
from engine.errors import InputError
from tests.cli import ROOT, one_line_error, run_tool
from tests.small_disk import run_on_small_disk, small_disk_available


def _tool(*args: str):
    return run_tool("preprocess_data.py", *args)


def _docs(corpus, n=20):
    with open(corpus["jsonl"]) as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f, strict=False)]


def _read(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_tokens_match_the_tokenizer(corpus, tokenizer_model, tmp_path):
    docs = _docs(corpus)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    stats = preprocess(
        str(src), str(tmp_path / "out"), tokenizer_model, append_eod=True, progress=False
    )
    tok = SentencePieceTokenizer(tokenizer_model)
    expected = [tok.tokenize(d) + [tok.eod] for d in docs]
    assert _read(tmp_path / "out_text_document") == expected
    assert stats.documents == len(docs) and stats.tokens == sum(map(len, expected))
    assert tok.detokenize(expected[0][:-1]) == docs[0]


def test_all_formats_give_the_same_dataset(corpus, tokenizer_model, tmp_path):
    docs = _docs(corpus, 12)
    lines = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))
    (tmp_path / "a.jsonl").write_text(lines)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    pq.write_table(
        pa.table({"id": list(range(len(docs))), "text": docs}),
        tmp_path / "a.parquet",
        row_group_size=5,
    )
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"doc{i:03d}.txt").write_text(d)
    outputs = {}
    for name in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "a.parquet", "txt"):
        prefix = tmp_path / f"out-{name}"
        preprocess(str(tmp_path / name), str(prefix), tokenizer_model, progress=False)
        outputs[name] = _read(f"{prefix}_text_document")
    first = outputs.pop("a.jsonl")
    assert len(first) == len(docs)
    for name, tokens in outputs.items():
        assert tokens == first, name


def test_worker_count_does_not_change_the_bytes(corpus, tokenizer_model, tmp_path):
    for workers in (1, 2, 3):
        preprocess(
            corpus["jsonl"],
            str(tmp_path / f"w{workers}"),
            tokenizer_model,
            append_eod=True,
            workers=workers,
            progress=False,
        )
    for suffix in (".bin", ".idx"):
        ref = (tmp_path / f"w1_text_document{suffix}").read_bytes()
        for workers in (2, 3):
            assert (tmp_path / f"w{workers}_text_document{suffix}").read_bytes() == ref


def test_several_json_keys_and_glob(tokenizer_model, tmp_path):
    for part in range(2):
        rows = [{"title": f"t{part}{i}", "body": f"def f{part}{i}(): pass"} for i in range(3)]
        (tmp_path / f"p{part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    preprocess(
        str(tmp_path / "p*.jsonl"),
        str(tmp_path / "o"),
        tokenizer_model,
        json_keys=["title", "body"],
        progress=False,
    )
    tok = SentencePieceTokenizer(tokenizer_model)
    assert _read(tmp_path / "o_title_document")[4] == tok.tokenize("t11")
    assert _read(tmp_path / "o_body_document")[0] == tok.tokenize("def f00(): pass")


def test_empty_documents_are_skipped_and_counted(tokenizer_model, tmp_path):
    rows = [{"text": "a = 1"}, {"text": ""}, {"text": "b = 2"}, {"text": None}]
    (tmp_path / "e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = preprocess(
        str(tmp_path / "e.jsonl"),
        str(tmp_path / "o"),
        tokenizer_model,
        append_eod=True,
        progress=False,
    )
    assert stats.documents == 2 and stats.empty == 2
    assert len(_read(tmp_path / "o_text_document")) == 2


BAD_JSONL = [
    ('{"text": "fine"}\n{"text": "broken\n', "line 2: malformed JSON"),
    ('{"text": "fine"}\n{"body": "x"}\n', "line 2: no key 'text' (keys: body)"),
    (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "line 2: bytes that are not UTF-8"),
    ('{"text": "fine"}\n[1, 2]\n', "line 2: a JSON object was expected"),
    ('{"text": 5}\n', "line 1: key 'text' holds int"),
]


@pytest.mark.parametrize("content, message", BAD_JSONL)
def test_bad_jsonl_stops_with_location_and_leaves_nothing(
    tokenizer_model, tmp_path, content, message
):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(InputError, match=re.escape(message)) as info:
        preprocess(str(src), str(tmp_path / "out"), tokenizer_model, workers=2, progress=False)
    assert str(src) in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


@pytest.mark.parametrize("content, message", BAD_JSONL)
def test_skip_bad_records_counts_them(tokenizer_model, tmp_path, content, message):
    src = tmp_path / "bad.jsonl"
    content = content if isinstance(content, bytes) else content.encode()
    src.write_bytes(content + b'{"text": "fine"}\n')  # an input of only bad records is refused
    good = src.read_bytes().count(b"fine")
    stats = preprocess(
        str(src), str(tmp_path / "out"), tokenizer_model, skip_bad_records=True, progress=False
    )
    assert stats.skipped == 1 and stats.documents == good
    assert len(_read(tmp_path / "out_text_document")) == good


def test_parquet_without_the_column(tokenizer_model, tmp_path):
    pq.write_table(pa.table({"content": ["x = 1", "y = 2"]}), tmp_path / "p.parquet")
    pq.write_table(pa.table({"text": ["z = 3"]}), tmp_path / "q.parquet")
    with pytest.raises(InputError, match=r"p.parquet: no column 'text' \(columns: content\)"):
        preprocess(
            str(tmp_path / "p.parquet"), str(tmp_path / "out"), tokenizer_model, progress=False
        )
    assert not list(tmp_path.glob("out*"))
    # Skipped, the file leaves no document at all: that is refused too, not written empty.
    with pytest.raises(InputError, match=r"no documents with text \(0 empty, 2 bad and skipped"):
        preprocess(
            str(tmp_path / "p.parquet"),
            str(tmp_path / "out"),
            tokenizer_model,
            skip_bad_records=True,
            progress=False,
        )
    assert not list(tmp_path.glob("out*"))
    stats = preprocess(
        [str(tmp_path / "p.parquet"), str(tmp_path / "q.parquet")],
        str(tmp_path / "out"),
        tokenizer_model,
        skip_bad_records=True,
        progress=False,
    )
    assert stats.skipped == 2 and stats.documents == 1


def test_bad_row_in_parquet_names_the_row(tokenizer_model, tmp_path):
    table = pa.table({"text": pa.array([b"ok", b"\xff\xfe"], type=pa.binary())})
    pq.write_table(table, tmp_path / "b.parquet")
    with pytest.raises(InputError, match=r"b.parquet:row 2: bytes that are not UTF-8"):
        preprocess(
            str(tmp_path / "b.parquet"), str(tmp_path / "o"), tokenizer_model, progress=False
        )


def _earlier_output(tokenizer_model, folder) -> tuple[str, dict[str, bytes]]:
    """A good dataset at <folder>/out, and its bytes, which failed runs must leave alone."""
    good = folder / "good.jsonl"
    good.write_text('{"text": "x = 1"}\n')
    prefix = str(folder / "out")
    preprocess(str(good), prefix, tokenizer_model, progress=False)
    before = {p.name: p.read_bytes() for p in folder.glob("out*")}
    assert set(before) == {"out_text_document.bin", "out_text_document.idx"}
    return prefix, before


def test_cli_error_is_one_line_exit_2_and_earlier_output_untouched(tokenizer_model, tmp_path):
    out, before = _earlier_output(tokenizer_model, tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x = 1"}\n{"text": \n')
    args = ["--tokenizer-model", tokenizer_model, "--output-prefix", out, "--no-progress"]
    assert "bad.jsonl:line 2" in one_line_error(_tool(*args, "--input", str(bad)))
    after = {p.name: p.read_bytes() for p in tmp_path.glob("out*")}
    assert after == before


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def _parquet(lines: bytes) -> bytes:
    sink = io.BytesIO()
    texts = [json.loads(line)["text"] for line in lines.splitlines()]
    pq.write_table(pa.table({"text": texts}), sink)
    return sink.getvalue()


# name -> (contents made from a few good JSONL lines, words the error line must hold)
BAD_INPUTS = {
    "empty.jsonl": (lambda lines: b"", "no documents with text"),
    "blank.jsonl": (lambda lines: b'{"text": ""}\n{"text": ""}\n', "no documents with text"),
    "cut.jsonl.gz": (lambda lines: _half(gzip.compress(lines)), "truncated or corrupt"),
    "cut.jsonl.zst": (lambda lines: _half(_zstd(lines)), "truncated or corrupt"),
    # A whole frame, then half of a small one: zstandard's stream reader took that for an end.
    "cut-frame.jsonl.zst": (
        lambda lines: _zstd(lines) + _half(_zstd(b'{"text": "y = 2"}\n' * 50)),
        "truncated or corrupt",
    ),
    "garbage.jsonl.gz": (lambda lines: b"not gzip at all\n" * 20, "truncated or corrupt"),
    "garbage.jsonl.zst": (lambda lines: b"not zstd at all\n" * 20, "truncated or corrupt"),
    "cut.parquet": (lambda lines: _half(_parquet(lines)), "truncated or corrupt"),
    "jsonl.parquet": (lambda lines: lines, "not a Parquet file"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_cli_refuses_empty_or_damaged_input_and_keeps_earlier_output(
    corpus, tokenizer_model, tmp_path, name
):
    out, before = _earlier_output(tokenizer_model, tmp_path)
    with open(corpus["jsonl"], "rb") as f:
        lines = b"".join(f.readlines()[:8])
    make, words = BAD_INPUTS[name]
    (tmp_path / name).write_bytes(make(lines))
    result = _tool(
        "--input",
        str(tmp_path / name),
        "--tokenizer-model",
        tokenizer_model,
        "--output-prefix",
        out,
        "--workers",
        "2",
        "--no-progress",
    )
    line = one_line_error(result)
    assert str(tmp_path / name) in line and words in line
    assert {p.name: p.read_bytes() for p in tmp_path.glob("out*")} == before
    assert not list(tmp_path.glob("*.tmp*"))


def test_multi_frame_zstd_is_read_whole(tokenizer_model, tmp_path):
    frames = [_zstd(f'{{"text": "x{i} = {i}"}}\n'.encode()) for i in range(3)]
    (tmp_path / "m.jsonl.zst").write_bytes(b"".join(frames))
    stats = preprocess(
        str(tmp_path / "m.jsonl.zst"), str(tmp_path / "o"), tokenizer_model, progress=False
    )
    assert stats.documents == 3


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_cli_unwritable_output_is_found_before_tokenizing(tokenizer_model, tmp_path, where):
    # The input has a bad second line: an error naming the output shows it was checked first.
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "x = 1"}\n{"text": \n')
    prefix = str(src / "out") if where == "under-a-file" else "/proc/tripod-test/out"
    result = _tool(
        "--input",
        str(src),
        "--tokenizer-model",
        tokenizer_model,
        "--output-prefix",
        prefix,
        "--workers",
        "2",
        "--no-progress",
    )
    line = one_line_error(result)
    assert f"{prefix}_text_document.bin" in line and "line 2" not in line
    assert "a file stands where a folder is needed" in line or "cannot be created" in line


# Runs inside the small disk's mount namespace (the tmpfs vanishes with it): preprocess a
# small input onto the disk, then one too large for it to the same prefix; print what was seen.
FULL_DISK_SCENARIO = """
import json, os, subprocess, sys
tool, model, small, large, disk = sys.argv[1:]
def run(src):
    args = ["--input", src, "--tokenizer-model", model, "--output-prefix", disk + "/out"]
    args += ["--workers", "2", "--no-progress"]
    done = subprocess.run([sys.executable, tool, *args], capture_output=True, text=True)
    return done.returncode, done.stderr
def files():
    return {n: open(os.path.join(disk, n), "rb").read().hex() for n in sorted(os.listdir(disk))}
first = run(small)
before = files()
second = run(large)
print(json.dumps({"first": first, "second": second, "before": before, "after": files()}))
"""


def test_cli_full_disk_is_one_line_and_keeps_earlier_output(corpus, tokenizer_model, tmp_path):
    if not small_disk_available():
        pytest.skip("no mount namespaces here for a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "x = 1"}\n')
    tool = os.path.join(ROOT, "tools", "preprocess_data.py")
    argv = [sys.executable, "-c", FULL_DISK_SCENARIO, tool, tokenizer_model, str(small)]
    argv += [corpus["jsonl"], str(disk)]  # about 700 KB of tokens: more than the disk holds
    done = run_on_small_disk(disk, "256k", argv)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["first"][0] == 0, seen["first"][1]
    assert set(seen["before"]) == {"out_text_document.bin", "out_text_document.idx"}
    code, stderr = seen["second"]
    line = one_line_error(subprocess.CompletedProcess([], code, "", stderr))
    assert "the disk is full" in line and f"{disk}/out_text_document" in line
    assert seen["after"] == seen["before"]  # intact, and no temporary files left


def test_cli_missing_input_and_progress_summary(tokenizer_model, tmp_path):
    args = ["--tokenizer-model", tokenizer_model, "--output-prefix", str(tmp_path / "o")]
    result = _tool("--input", str(tmp_path / "none.jsonl"), *args)
    assert "none.jsonl: no such file" in one_line_error(result)
    src = tmp_path / "s.jsonl"
    src.write_text("".join(json.dumps({"text": f"v{i} = {i}"}) + "\n" for i in range(30)))
    result = _tool("--input", str(src), *args, "--log-interval", "10", "--workers", "2")
    assert result.returncode == 0, result.stderr
    assert "documents: 30" in result.stdout and "skipped (bad): 0" in result.stdout
    assert "docs/s" in result.stderr and "tokens/s" in result.stderr


def test_dtype_follows_vocabulary(dataset_prefix):
    assert IndexedDataset(dataset_prefix).dtype == np.uint16


def test_preprocessing_never_imports_torch():
    """Start-up stays small: the tool, its CLI wrapper and the pipeline do not need torch."""
    code = (
        "import sys, tools.preprocess_data, tools.train_tokenizer, engine.data.prepare.preprocess; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def _encode_recording_the_pid(*args, pid_file: str, **kwargs):
    """In the worker process: note which process tokenizes this batch, then tokenize it."""
    with open(pid_file, "a") as f:
        f.write(f"{os.getpid()}\n")
    return encode_batch(*args, **kwargs)


def test_batches_in_flight_are_bounded_and_workers_are_replaced(
    corpus, tokenizer_model, tmp_path, monkeypatch
):
    """The memory bound, counted on a real run: batches read but not yet written never exceed
    2 x workers (+1 being handed out), and each worker process tokenizes at most
    BATCHES_PER_WORKER batches before a fresh one replaces it (the worker's pid, written by the
    worker itself). Batches are made small so that a small corpus gives many."""
    from engine.data.prepare import preprocess as module

    monkeypatch.setattr(module, "BATCH_BYTES", 2000)
    pulled, consumed, peak = [0], [0], [0]
    real_batches, real_consume = module._batches, module._consume
    pids = tmp_path / "pids"

    def counted_batches(records):
        for batch in real_batches(records):
            pulled[0] += 1
            peak[0] = max(peak[0], pulled[0] - consumed[0])
            yield batch

    def counted_consume(*args):
        consumed[0] += 1
        return real_consume(*args)

    monkeypatch.setattr(module, "_batches", counted_batches)
    monkeypatch.setattr(module, "_consume", counted_consume)
    # (the workers start from the forkserver: the pid file's name goes with each batch)
    recording = functools.partial(_encode_recording_the_pid, pid_file=str(pids))
    monkeypatch.setattr(module, "encode_batch", recording)
    workers = 2
    preprocess(corpus["jsonl"], str(tmp_path / "out"), tokenizer_model, append_eod=True,
               workers=workers, progress=False)  # fmt: skip
    per_worker = collections.Counter(pids.read_text().split())
    assert pulled[0] == consumed[0] == sum(per_worker.values()) > 2 * module.BATCHES_PER_WORKER
    assert peak[0] <= 2 * workers + 1, peak[0]
    assert max(per_worker.values()) <= module.BATCHES_PER_WORKER, per_worker
    assert len(per_worker) >= pulled[0] / module.BATCHES_PER_WORKER
    # and the output is the one an unbounded, unrecycled run writes
    monkeypatch.undo()
    preprocess(corpus["jsonl"], str(tmp_path / "ref"), tokenizer_model, append_eod=True,
               workers=1, progress=False)  # fmt: skip
    for suffix in (".bin", ".idx"):
        ours = (tmp_path / f"out_text_document{suffix}").read_bytes()
        assert ours == (tmp_path / f"ref_text_document{suffix}").read_bytes()
