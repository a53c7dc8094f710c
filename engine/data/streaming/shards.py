"""Parquet shards for streaming: finding them, checking them, and reading row ranges.

A source is one `--data-path` entry: a `.parquet` file or a folder of them (searched
recursively, in sorted order). Every problem is an InputError of one line that names the shard
and, once reading has started, the row.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from engine.errors import InputError
from parallel.errors import describe_os_error

PARQUET_SUFFIX = ".parquet"


@dataclass(frozen=True)
class Shard:
    """One Parquet file of a source: its path, its name inside the source, and its row count."""

    path: str
    name: str
    num_rows: int


def is_parquet_path(path: str) -> bool:
    """A `.parquet` file, or a folder (which must then hold Parquet files) that is not also
    the prefix of a preprocessed dataset (megatron-core keeps its index caches in a folder
    named as the prefix, beside its .bin and .idx)."""
    if path.endswith(PARQUET_SUFFIX):
        return True
    return os.path.isdir(path) and not os.path.exists(path + ".idx")


def shard_paths(source: str) -> list[tuple[str, str]]:
    """(path, name inside the source) of each shard of a file or folder, in sorted order."""
    if os.path.isdir(source):
        found = sorted(glob.glob(os.path.join(source, "**", "*" + PARQUET_SUFFIX), recursive=True))
        if not found:
            raise InputError(
                f"--data-path {source}: a folder with no .parquet files; give Parquet files or "
                "folders of them, or a prefix of a preprocessed .bin/.idx dataset"
            )
        return [(path, os.path.relpath(path, source)) for path in found]
    if not os.path.exists(source):
        raise InputError(f"--data-path {source}: no such Parquet file or folder")
    return [(source, os.path.basename(source))]


def _open(path: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except OSError as err:
        if err.errno is not None:
            raise InputError(describe_os_error(err, path)) from None
        raise _corrupt(path, err, None) from None
    except pa.ArrowException as err:
        raise _corrupt(path, err, None) from None


def _corrupt(path: str, err: Exception, row: int | None) -> InputError:
    detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    what = "not a Parquet file, or truncated or corrupt"
    if row is not None:
        what = f"rows from {row} on are unreadable, the shard is truncated or corrupt"
    return InputError(
        f"{path}: {what} ({detail}); re-create or re-download the shard, or leave it out of "
        "--data-path"
    )


def open_shards(source: str, column: str) -> list[Shard]:
    """The shards of a source, each checked to open and to hold a text column `column`."""
    import pyarrow as pa

    shards = []
    for path, name in shard_paths(source):
        parquet = _open(path)
        schema = parquet.schema_arrow
        if column not in schema.names:
            raise InputError(
                f"{path}: no column {column!r} (columns: {', '.join(schema.names)}); pick the "
                "text column with --parquet-text-column"
            )
        kind = schema.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise InputError(
                f"{path}: column {column!r} holds {kind}, not text; pick the text column with "
                "--parquet-text-column"
            )
        shards.append(Shard(path, name, parquet.metadata.num_rows))
    if not sum(shard.num_rows for shard in shards):
        raise InputError(
            f"--data-path {source}: its Parquet files hold no rows; give documents or leave it "
            "out of --data-path"
        )
    return shards


class ShardCursor:
    """Reads rows [start, stop) of one column, continuing without re-reading when the next
    range lies further on in the same shard (a worker reads its windows in shard order).
    Row groups are read one at a time, so a damaged one is named by its first row."""

    def __init__(self, column: str, batch_rows: int = 1024):
        self.column = column
        self.batch_rows = batch_rows
        self.path: str | None = None
        self.parquet = None
        self.groups: list[tuple[int, int]] = []  # (row group, its first row) still to read
        self.batches = None
        self.row = 0  # the shard row of self.pending[0]
        self.pending = None  # the unread rest of the last record batch

    def texts(self, shard: Shard, start: int, stop: int) -> list[str]:
        """The text of rows [start, stop) of `shard`; InputError naming shard and row."""
        if self.path != shard.path or start < self.row or self._skippable(start):
            self._seek(shard, start)
        texts: list[str] = []
        while self.row < stop:
            if self.pending is None or len(self.pending) == 0:
                self.pending = self._next_batch(shard)
            skip = max(0, start - self.row)
            take = min(len(self.pending), stop - self.row)
            if take > skip:
                values = self.pending.slice(skip, take - skip).to_pylist()
                texts.extend(self._checked(values, shard, self.row + skip))
            self.pending = self.pending.slice(take)
            self.row += take
        return texts

    def _skippable(self, start: int) -> bool:
        """Whether `start` lies past the row group being read (seeking skips its decoding)."""
        return bool(self.groups) and self.groups[0][1] <= start

    def _seek(self, shard: Shard, start: int) -> None:
        self.parquet = _open(shard.path)
        metadata = self.parquet.metadata
        self.groups, first_row = [], 0
        for group in range(metadata.num_row_groups):
            rows = metadata.row_group(group).num_rows
            if first_row + rows > start:
                self.groups.append((group, first_row))
            first_row += rows
        self.path = shard.path
        self.row = self.groups[0][1] if self.groups else first_row
        self.pending = None
        self.batches = iter(())

    def _next_batch(self, shard: Shard):
        import pyarrow as pa

        try:
            while True:
                batch = next(self.batches, None)
                if batch is not None:
                    return batch.column(0)
                if not self.groups:
                    break
                group, self.row = self.groups.pop(0)
                self.batches = self.parquet.iter_batches(
                    batch_size=self.batch_rows,
                    row_groups=[group],
                    columns=[self.column],
                    use_threads=False,
                )
        except (pa.ArrowException, OSError) as err:
            self.path = None
            raise _corrupt(shard.path, err, self.row) from None
        self.path = None
        raise InputError(
            f"{shard.path}: ends at row {self.row}, but its metadata promised "
            f"{shard.num_rows} rows; re-create or re-download the shard"
        )

    @staticmethod
    def _checked(values: list, shard: Shard, first_row: int) -> list[str]:
        for i, value in enumerate(values):
            if value is None:
                raise InputError(
                    f"{shard.path}: row {first_row + i}: the text is null; drop or fill such "
                    "rows, or leave the shard out of --data-path"
                )
        return values
