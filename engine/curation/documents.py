"""Documents of one input file with every field kept, and Parquet shards written back.

JSONL (plain, .gz, .zst) gives its records as they are, Parquet all its columns (and its
schema, which the shards written from it keep), a text file one document {"text": ...}, a
WARC or WET file its pages with their URL, date and record id. A
record that is not a JSON object, or whose text field is missing or not a string, is an
InputError naming the file and line (or row).

JSONL fields have no schema: each shard's columns take the Arrow type of their values, and a
field whose values have none in common (a number in one record, a string in another; an
empty object) is kept as JSON text.
"""

from __future__ import annotations

import io
import json
import os
from collections import Counter

from engine.curation.atomic import temporary
from engine.curation.web.warc import is_warc, read_warc
from engine.data.prepare.readers import PARQUET_SUFFIXES, TEXT_SUFFIXES, iter_records
from engine.errors import InputError

FIX = "name the text field with text_key in --config"


def read_documents(path: str, text_key: str, fix: str = FIX):
    """(rows, the Arrow schema of a Parquet file or None): the whole file."""
    rows, schema = [], None
    for part, part_schema in iter_documents(path, text_key, 1 << 62, fix):
        rows.extend(part)
        schema = part_schema
    return rows, schema


def iter_documents(path: str, text_key: str, per_part: int, fix: str = FIX, skipped=None):
    """(rows, schema or None) for each run of `per_part` documents of the file, read as it
    goes: memory holds one part, not the file. A WARC or WET file gives its pages
    (engine/curation/web/warc.py), counting the records it leaves out in `skipped` (a
    Counter)."""
    if is_warc(path):
        counts = skipped if skipped is not None else Counter()
        yield from _in_parts(read_warc(path, text_key, counts), per_part)
        return
    if path.lower().endswith(PARQUET_SUFFIXES):
        yield from _parquet_parts(path, text_key, per_part, fix)
        return
    if path.lower().endswith(TEXT_SUFFIXES):
        with open(path, "rb") as f:
            data = f.read()
        try:
            yield [{text_key: data.decode("utf-8")}], None
        except UnicodeDecodeError as err:
            raise InputError(
                f"{path}: bytes that are not UTF-8 at byte {err.start}; fix its encoding"
            ) from None
        return
    yield from _in_parts(_jsonl_rows(path, text_key, fix), per_part)


def _in_parts(rows, per_part: int):
    """(rows, None) for each run of `per_part` of the rows."""
    part = []
    for row in rows:
        part.append(row)
        if len(part) == per_part:
            yield part, None
            part = []
    if part:
        yield part, None


def _jsonl_rows(path: str, text_key: str, fix: str):
    for record in iter_records([path], [text_key]):
        try:
            row = json.loads(record.payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise InputError(f"{record.where}: not a JSON object ({err}); fix or drop it") from None
        if not isinstance(row, dict) or not isinstance(row.get(text_key), str):
            raise InputError(f"{record.where}: no string field {text_key!r}; {fix}")
        yield row


def _parquet_parts(path: str, text_key: str, per_part: int, fix: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
    except (pa.ArrowException, OSError) as err:
        raise InputError(f"{path}: not a Parquet file, or damaged ({err}); re-create it") from None
    if text_key not in schema.names:
        raise InputError(
            f"{path}: no column {text_key!r} (columns: {', '.join(schema.names)}); {fix}"
        )
    number = 0
    batches = parquet.iter_batches(batch_size=min(per_part, 1 << 20))
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as err:
            raise InputError(f"{path}: damaged after row {number} ({err}); re-create it") from None
        if batch is None:
            return
        rows = pa.Table.from_batches([batch], schema).to_pylist()
        for row in rows:
            number += 1
            if not isinstance(row[text_key], str):
                raise InputError(f"{path}:row {number}: {text_key!r} is not a string; {fix}")
        yield rows, schema


def _writable(array) -> bool:
    """Whether Parquet can store the column (it cannot, e.g., a struct with no fields)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pq.write_table(pa.table({"c": array}), io.BytesIO())
    except (pa.ArrowException, OverflowError):
        return False
    return True


def _column(values: list):
    import pyarrow as pa

    try:
        array = pa.array(values)
        if _writable(array):
            return array
    except (pa.ArrowException, OverflowError):
        pass
    return pa.array([None if v is None else json.dumps(v) for v in values], pa.string())


def write_parquet(
    path: str,
    rows: list[dict],
    text_key: str,
    extra: dict[str, list] | None = None,
    schema=None,
) -> None:
    """rows (a field missing from a row is null) plus `extra` string columns, in `schema`
    when given (the input's), written to a temporary file then renamed, so that `path` is
    whole or absent."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if schema is not None:
        table = pa.Table.from_pylist(rows, schema=schema)
    else:
        names: dict[str, None] = {text_key: None}
        for row in rows:
            names.update(dict.fromkeys(row))
        table = pa.table({name: _column([row.get(name) for row in rows]) for name in names})
        if not rows:
            table = pa.table({text_key: pa.array([], pa.string())})
    for name, values in (extra or {}).items():
        table = table.append_column(name, pa.array(values, pa.string()))
    tmp = temporary(path)  # not a .parquet name: a reader of the folder never takes it
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def read_parquet_rows(path: str):
    """(rows, schema) of a shard written by write_parquet."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    return table.to_pylist(), table.schema
