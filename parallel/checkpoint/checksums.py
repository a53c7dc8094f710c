"""Checksums of every file a DCP save writes, computed while the bytes are written.

`ChecksummingWriter` is DCP's FileSystemWriter whose streams pass every written buffer
through xxHash (XXH3, 64 bits: tens of GB/s on one core, so it costs a small fraction of the
write itself). After `dcp.save` returns, `writer.files` maps each file this process wrote (the
data files, and `.metadata` on the coordinator) to its size and digest. `file_digest` reads a
file back to compare.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

DIGEST = "xxh3_64"
_READ_CHUNK = 8 << 20


class _HashingStream:
    """A binary file being written, with a running digest of everything written to it (the
    file methods DCP and torch.save use: write, tell, flush, fileno, close)."""

    def __init__(self, raw, errors: list[OSError]):
        self.raw = raw
        self.hash = xxhash.xxh3_64()
        self.size = 0
        self.errors = errors

    def _io(self, operation, *args):
        # torch.save's writer reports a failed write as a RuntimeError of its own; keep the
        # OSError (a full disk, say) so the caller can say what really happened.
        try:
            return operation(*args)
        except OSError as err:
            self.errors.append(err)
            raise

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self._io(self.raw.write, view)
        written = len(view) if written is None else written
        self.hash.update(view[:written])
        self.size += written
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self._io(self.raw.flush)

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self._io(self.raw.close)


class _ChecksummingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, dict] = {}
        self.errors: list[OSError] = []

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw, self.errors)
            yield stream
        # DCP writes `.metadata` as `.metadata.tmp` and renames it: record the final name.
        name = os.path.basename(os.fspath(path)).removesuffix(".tmp")
        self.files[name] = {"bytes": stream.size, DIGEST: stream.hash.hexdigest()}


class ChecksummingWriter(FileSystemWriter):
    """FileSystemWriter that records {file name: {"bytes", "xxh3_64"}} in `files`."""

    def __init__(self, path, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.fs = _ChecksummingFileSystem()

    @property
    def files(self) -> dict[str, dict]:
        return self.fs.files

    @property
    def errors(self) -> list[OSError]:
        """OSErrors met while writing (torch.save may report them as RuntimeErrors)."""
        return self.fs.errors


def file_digest(path: str) -> str:
    """The xxh3_64 hex digest of a file, read in chunks."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
