"""Streaming readers of raw text inputs: JSONL (plain, .gz, .zst), Parquet and plain-text files.

Readers yield `Record`s one by one and never hold a whole file: JSONL line by line, Parquet in
record batches of only the wanted columns. Parsing and validation of a record (JSON, UTF-8,
keys) happens in `decode_record`, which the tokenizing workers call, so a bad record is
reported with its file and line or row wherever it is processed. A file that cannot be read to
its end (a cut or corrupt .gz/.zst, a damaged or non-Parquet .parquet, an I/O error) is an
InputError naming it, never a quietly shorter input.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from engine.errors import InputError
from parallel.errors import describe_os_error

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt",)
SUPPORTED = JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES


@dataclass(frozen=True)
class Record:
    """One raw document before decoding.

    kind: "json" (payload = the bytes of one JSONL line), "text" (payload = bytes of a whole
    plain-text file) or "columns" (payload = dict of column name -> str from Parquet).
    where: "path:line N", "path:row N" or "path", used in error messages.
    """

    kind: str
    where: str
    payload: object
    size: int


def _suffix_of(path: str, supported: tuple[str, ...] = SUPPORTED) -> str | None:
    lower = path.lower()
    for suffix in sorted(supported, key=len, reverse=True):
        if lower.endswith(suffix):
            return suffix
    return None


def _files_under(folder: str, supported: tuple[str, ...] = SUPPORTED) -> list[str]:
    """The data files under `folder`, through linked folders too (each real folder once); a
    link to a data file that does not exist is an InputError, not a file silently left out."""
    found, seen = [], set()
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # a link back to a folder already walked
            dirs[:] = []
            continue
        seen.add(real)
        for name in names:
            path = os.path.join(root, name)
            if not _suffix_of(path, supported):
                continue
            if not os.path.exists(path):
                raise InputError(
                    f"{path}: a link to {os.readlink(path)}, which does not exist; fix the "
                    "link or remove it"
                )
            if os.path.isfile(path):
                found.append(path)
    return sorted(found)


def expand_inputs(spec: str | list[str], supported: tuple[str, ...] = SUPPORTED) -> list[str]:
    """Files named by --input: a file, a glob, a folder (searched recursively), or a list;
    `supported`: the file types taken (tools/curate.py adds WARC files)."""
    specs = [spec] if isinstance(spec, str | os.PathLike) else list(spec)
    files: list[str] = []
    for item in specs:
        item = os.fspath(item)
        if os.path.isdir(item):
            found = _files_under(item, supported)
            if not found:
                raise InputError(
                    f"{item}: folder holds no {', '.join(supported)} files; point --input at "
                    "the data files"
                )
            files.extend(found)
        elif os.path.isfile(item):
            files.append(item)
        else:
            matches = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not matches:
                raise InputError(f"{item}: no such file, folder or glob match; check --input")
            files.extend(matches)
    for path in files:
        if _suffix_of(path, supported) is None:
            raise InputError(f"{path}: unsupported file type; --input takes {', '.join(supported)}")
    return files


class _Damaged(Exception):
    """A compressed stream that cannot be decoded to its end: args (format, detail)."""


# Compressed bytes handed to the decoder at a time. Its output for them is unbounded (a run of
# zeros compresses ~30,000x), so the input is kept small: at most ~0.5 GB of output per call.
ZSTD_READ_SIZE = 1 << 14


def _zstd_chunks(f) -> Iterator[bytes]:
    """Decompressed bytes of every zstd frame in `f`; _Damaged if the last frame is cut short.

    zstandard's stream_reader stops quietly at a cut frame, which would lose the rest of the
    file without a word, so the frames are decoded one by one and each must reach its end.
    """
    import zstandard

    frame = None
    try:
        while chunk := f.read(ZSTD_READ_SIZE):
            while chunk:
                if frame is None:
                    frame = zstandard.ZstdDecompressor().decompressobj()
                yield frame.decompress(chunk)
                chunk = b""
                if frame.eof:  # bytes after a finished frame start the next one
                    chunk, frame = frame.unused_data, None
    except zstandard.ZstdError as err:
        raise _Damaged("zstd", str(err)) from None
    if frame is not None:
        raise _Damaged("zstd", "the file ends inside a frame")


def _split_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Lines (each with its b"\\n", the last perhaps without) of a stream of byte chunks."""
    head: list[bytes] = []
    for chunk in chunks:
        *lines, tail = chunk.split(b"\n")
        if lines:
            yield b"".join(head) + lines[0] + b"\n"
            for line in lines[1:]:
                yield line + b"\n"
            head = []
        if tail:
            head.append(tail)
    if head:
        yield b"".join(head)


def _jsonl_lines(path: str) -> Iterator[bytes]:
    if path.endswith(".zst"):
        with open(path, "rb") as f:
            yield from _split_lines(_zstd_chunks(f))
    elif path.endswith(".gz"):
        try:
            with gzip.open(path, "rb") as f:
                yield from f
        except (EOFError, zlib.error, gzip.BadGzipFile) as err:
            raise _Damaged("gzip", str(err)) from None
    else:
        with open(path, "rb") as f:
            yield from f


def _read_jsonl(path: str) -> Iterator[Record]:
    number = 0
    try:
        for number, line in enumerate(_jsonl_lines(path), start=1):
            if line.strip():
                yield Record("json", f"{path}:line {number}", line, len(line))
    except _Damaged as err:
        kind, detail = err.args
        where = f"after line {number}" if number else "from the start"
        raise InputError(
            f"{path}: truncated or corrupt {kind} data {where} ({detail}); re-create or "
            "re-download it, or leave it out of --input"
        ) from None


def _parquet_error(path: str, err: Exception) -> InputError:
    if isinstance(err, OSError) and err.errno is not None:  # the system's error, not Arrow's
        return InputError(describe_os_error(err, path))
    return InputError(
        f"{path}: not a Parquet file, or truncated or corrupt ({err}); re-create or "
        "re-download it, or leave it out of --input"
    )


def _read_parquet(path: str, keys: list[str], skip_bad: bool, stats: dict) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise _parquet_error(path, err) from None
    names = parquet.schema_arrow.names
    missing = [k for k in keys if k not in names]
    if missing:
        message = (
            f"{path}: no column {missing[0]!r} (columns: {', '.join(names)}); "
            "pick the text column with --json-keys"
        )
        if not skip_bad:
            raise InputError(message)
        stats["skipped"] = stats.get("skipped", 0) + parquet.metadata.num_rows
        stats.setdefault("skip_messages", []).append(message)
        return
    row = 0
    batches = parquet.iter_batches(batch_size=1024, columns=keys)
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as err:
            raise _parquet_error(path, err) from None
        if batch is None:
            return
        columns = [batch.column(k).to_pylist() for k in keys]
        for values in zip(*columns, strict=False):
            row += 1
            payload = dict(zip(keys, values, strict=False))
            size = sum(len(v) for v in values if isinstance(v, str | bytes))
            yield Record("columns", f"{path}:row {row}", payload, size)


def _read_text(path: str) -> Iterator[Record]:
    with open(path, "rb") as f:
        data = f.read()
    yield Record("text", path, data, len(data))


def iter_records(
    files: list[str], keys: list[str], skip_bad: bool = False, stats: dict | None = None
) -> Iterator[Record]:
    """Records of every file in order. `stats` collects file-level skips (missing columns)."""
    stats = {} if stats is None else stats
    for path in files:
        try:
            yield from _read_file(path, keys, skip_bad, stats)
        except OSError as err:  # unreadable: permissions, I/O error, vanished file
            raise InputError(describe_os_error(err, path)) from None


def _read_file(path: str, keys: list[str], skip_bad: bool, stats: dict) -> Iterator[Record]:
    suffix = _suffix_of(path)
    if suffix in JSONL_SUFFIXES:
        yield from _read_jsonl(path)
    elif suffix in PARQUET_SUFFIXES:
        yield from _read_parquet(path, keys, skip_bad, stats)
    else:
        if keys != ["text"]:
            raise InputError(
                f"{path}: plain-text files have only the key 'text', not {keys}; "
                "drop --json-keys or use JSONL/Parquet input"
            )
        yield from _read_text(path)


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(
            f"{where}: bytes that are not UTF-8 at byte {err.start}; fix the encoding or "
            "pass --skip-bad-records"
        ) from None


def decode_record(record: Record, keys: list[str]) -> dict[str, str]:
    """The text of each key, or InputError naming the record and the problem."""
    if record.kind == "text":
        return {"text": _utf8(record.payload, record.where)}
    if record.kind == "columns":
        values = record.payload
    else:
        line = _utf8(record.payload, record.where)
        try:
            values = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(
                f"{record.where}: malformed JSON ({err.msg} at column {err.colno}); fix the "
                "line or pass --skip-bad-records"
            ) from None
        if not isinstance(values, dict):
            raise InputError(
                f"{record.where}: a JSON object was expected, found {values!r:.40}; write one "
                'object per line, such as {"text": "..."}'
            )
    texts = {}
    for key in keys:
        if key not in values:
            present = ", ".join(map(str, values)) or "none"
            raise InputError(
                f"{record.where}: no key {key!r} (keys: {present}); pick the field with "
                "--json-keys or pass --skip-bad-records"
            )
        value = values[key]
        if isinstance(value, bytes):
            value = _utf8(value, record.where)
        if value is None:
            value = ""
        if not isinstance(value, str):
            raise InputError(
                f"{record.where}: key {key!r} holds {type(value).__name__}, not text; give "
                "--json-keys the key that holds the text (or --skip-bad-records to skip it)"
            )
        texts[key] = value
    return texts
