"""Documents of one input file with every field kept, and Parquet shards written back.

JSONL (plain, .gz, .zst) gives its records as they are, Parquet all its columns, a text file
one document {"text": ...}. A record that is not a JSON object, or lacks the text field, is
an InputError naming the file and line.
"""

from __future__ import annotations

import json
import os

from engine.data.readers import PARQUET_SUFFIXES, TEXT_SUFFIXES, iter_records
from engine.errors import InputError


def read_documents(path: str, text_key: str) -> list[dict]:
    if path.lower().endswith(PARQUET_SUFFIXES):
        return _parquet_rows(path, text_key)
    if path.lower().endswith(TEXT_SUFFIXES):
        with open(path, "rb") as f:
            data = f.read()
        try:
            return [{text_key: data.decode("utf-8")}]
        except UnicodeDecodeError as err:
            raise InputError(f"{path}: bytes that are not UTF-8 at byte {err.start}") from None
    rows = []
    for record in iter_records([path], [text_key]):
        try:
            row = json.loads(record.payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise InputError(f"{record.where}: not a JSON object ({err}); fix or drop it") from None
        if not isinstance(row, dict) or not isinstance(row.get(text_key), str):
            raise InputError(
                f"{record.where}: no string field {text_key!r}; name the text field with "
                "text_key in --config"
            )
        rows.append(row)
    return rows


def _parquet_rows(path: str, text_key: str) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise InputError(f"{path}: not a Parquet file, or damaged ({err})") from None
    if text_key not in table.column_names:
        raise InputError(
            f"{path}: no column {text_key!r} (columns: {', '.join(table.column_names)}); name "
            "the text field with text_key in --config"
        )
    return table.to_pylist()


def write_parquet(path: str, rows: list[dict], extra: dict[str, list] | None = None) -> None:
    """rows (any fields; a field missing from a row is null) plus `extra` columns, written
    to a temporary file then renamed, so that `path` is whole or absent."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    columns = {}
    for name in names:
        values = [row.get(name) for row in rows]
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed types: kept as JSON text
            columns[name] = pa.array([None if v is None else json.dumps(v) for v in values])
    for name, values in (extra or {}).items():
        columns[name] = pa.array(values, type=pa.string())
    table = pa.table(columns) if columns else pa.table({"text": pa.array([], pa.string())})
    tmp = f"{path}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def read_parquet_rows(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()
