"""Megatron-LM's MMIDIDX indexed dataset: a `.bin` of token ids and an `.idx` describing it.

The `.idx` layout, all little-endian, exactly as Megatron-LM writes and reads it:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code of the tokens in .bin (see DTYPE_CODES)
    u64       sequence count S
    u64       document count D (entries of the document index, i.e. documents + 1)
    i32[S]    tokens in each sequence
    i64[S]    byte offset of each sequence in .bin
    i64[D]    document index: sequence index where each document starts, then S

preprocess_data.py writes one sequence per document, so the document index is 0, 1, ..., S.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import struct
from pathlib import Path

import numpy as np

from engine.errors import InputError
from parallel.errors import describe_os_error

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class IndexedDatasetError(InputError):
    """A .bin/.idx pair that is missing, corrupt or inconsistent; the message names the file."""


def write_error(err: OSError, path: str | os.PathLike) -> InputError:
    """The one-line error for an OSError met while writing the output file `path`."""
    return InputError(describe_os_error(err, path, writing=True))


@contextlib.contextmanager
def writing(path: str | os.PathLike):
    """Turn an OSError inside the block (full disk, unwritable place) into write_error(path)."""
    try:
        yield
    except OSError as err:
        raise write_error(err, path) from None


def optimal_dtype(vocab_size: int | None) -> type:
    """Token dtype Megatron-LM picks: uint16 while the vocabulary fits, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def index_file(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def dataset_exists(prefix: str | os.PathLike) -> bool:
    return os.path.isfile(data_file(prefix)) and os.path.isfile(index_file(prefix))


class IndexedDatasetBuilder:
    """Writes a dataset under temporary names; `finalize()` renames both files into place.

    Until `finalize()` returns nothing exists at the final `.bin`/`.idx` paths, and `abort()`
    (or an exception inside a `with` block) removes the temporary files. `finalize()` is
    `prepare()` (write everything; where a full disk shows) then `commit()` (rename), so that
    several datasets written together can all be prepared before any of them is committed.
    An OSError while writing (full disk, unwritable path) is an InputError naming the path.
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.int32):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        self._tmp_bin = f"{data_file(self.prefix)}.tmp.{os.getpid()}"
        self._tmp_idx = f"{index_file(self.prefix)}.tmp.{os.getpid()}"
        with writing(data_file(self.prefix)):
            Path(self._tmp_bin).parent.mkdir(parents=True, exist_ok=True)
            self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed in finalize/abort
        self._lengths: list[np.ndarray] = []
        self._pending: list[int] = []
        self._doc_starts: list[int] = [0]
        self._num_sequences = 0

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def add_document(self, tokens) -> None:
        """Append one document made of one sequence."""
        self.add_sequence(tokens)
        self.end_document()

    def add_sequence(self, tokens) -> None:
        array = np.asarray(tokens, dtype=self.dtype)
        with writing(data_file(self.prefix)):
            self._bin.write(array.tobytes(order="C"))
        self._pending.append(array.size)
        self._num_sequences += 1
        if len(self._pending) >= 65536:
            self._flush_lengths()

    def add_sequences(self, flat_tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many one-sequence documents given as one flat array and their lengths."""
        flat = np.ascontiguousarray(flat_tokens, dtype=self.dtype)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != flat.size:
            raise ValueError("lengths do not add up to the number of tokens")
        self._flush_lengths()
        with writing(data_file(self.prefix)):
            self._bin.write(flat.tobytes(order="C"))
        self._lengths.append(lengths.astype(np.int32))
        first = self._num_sequences + 1
        self._num_sequences += len(lengths)
        self._doc_starts.extend(range(first, self._num_sequences + 1))

    def end_document(self) -> None:
        self._doc_starts.append(self._num_sequences)

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append every sequence and document of an existing dataset (for merging)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{index_file(prefix)}: tokens are {other.dtype}, the merged dataset is "
                f"{self.dtype}; merge only datasets made with the same tokenizer"
            )
        self._flush_lengths()
        base = self._num_sequences
        self._lengths.append(other.sequence_lengths.astype(np.int32))
        self._doc_starts.extend((other.document_indices[1:] + base).tolist())
        self._num_sequences += len(other)
        other.close()
        with open(data_file(prefix), "rb") as source, writing(data_file(self.prefix)):
            shutil.copyfileobj(source, self._bin, length=16 << 20)

    def _flush_lengths(self) -> None:
        if self._pending:
            self._lengths.append(np.asarray(self._pending, dtype=np.int32))
            self._pending = []

    def finalize(self) -> None:
        """Write the index and move both files into place (.bin first, then .idx)."""
        self.prepare()
        self.commit()

    def prepare(self) -> None:
        """Close the data file and write the index, both still under their temporary names."""
        self._flush_lengths()
        with writing(data_file(self.prefix)):
            self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.asarray(self._doc_starts, dtype=np.int64)
        with writing(index_file(self.prefix)):
            write_index(self._tmp_idx, self.dtype, lengths, pointers, documents)

    def commit(self) -> None:
        """Move the prepared files into place (.bin first, then .idx)."""
        with writing(self.prefix):
            os.replace(self._tmp_bin, data_file(self.prefix))
            os.replace(self._tmp_idx, index_file(self.prefix))

    def abort(self) -> None:
        """Drop everything written so far; the final paths are never touched."""
        if not self._bin.closed:
            self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)


def write_index(path, dtype, lengths, pointers, documents) -> None:
    """Write an .idx file in Megatron-LM's layout (see the module docstring)."""
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODE_OF_DTYPE[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(documents)))
        f.write(np.asarray(lengths, dtype="<i4").tobytes(order="C"))
        f.write(np.asarray(pointers, dtype="<i8").tobytes(order="C"))
        f.write(np.asarray(documents, dtype="<i8").tobytes(order="C"))


class IndexedDataset:
    """Memory-mapped reader of a `.bin`/`.idx` pair, validated on open.

    `get(i, offset, length)` returns a read-only numpy view of part of sequence i without
    copying; `dataset[i]` the whole sequence.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        idx_path, bin_path = index_file(self.prefix), data_file(self.prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(
                    f"{path}: no such file; --data-path takes the prefix that .bin and .idx "
                    "are appended to (e.g. data/corpus_text_document)"
                )
        self._idx_file = open(idx_path, "rb")  # noqa: SIM115 - closed in close()
        try:
            self._read_index(idx_path)
            self._open_data(bin_path)
        except BaseException:
            self.close()
            raise

    def _read_index(self, path: str) -> None:
        idx_size = os.path.getsize(path)
        header = self._idx_file.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE:
            raise IndexedDatasetError(
                f"{path}: truncated header ({len(header)} of {HEADER_SIZE} bytes)"
            )
        if header[: len(MAGIC)] != MAGIC:
            raise IndexedDatasetError(
                f"{path}: bad magic {header[: len(MAGIC)]!r}, expected {MAGIC!r} "
                "(not a Megatron MMIDIDX index)"
            )
        version, code, num_sequences, num_documents = struct.unpack("<QBQQ", header[len(MAGIC) :])
        if version != VERSION:
            raise IndexedDatasetError(f"{path}: index version {version}, only {VERSION} is known")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{path}: unknown token dtype code {code}")
        expected = HEADER_SIZE + num_sequences * (4 + 8) + num_documents * 8
        if idx_size not in (expected, expected + num_sequences):  # + optional sequence modes
            raise IndexedDatasetError(
                f"{path}: {idx_size} bytes, but its header describes {num_sequences} sequences "
                f"and {num_documents} document entries ({expected} bytes); the file is "
                "truncated or corrupt, re-run preprocess_data.py"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        self._index_buffer = mmap.mmap(self._idx_file.fileno(), 0, access=mmap.ACCESS_READ)
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._index_buffer, "<i4", num_sequences, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(self._index_buffer, "<i8", num_sequences, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(self._index_buffer, "<i8", num_documents, offset)
        docs = self.document_indices
        if num_documents == 0 or docs[0] != 0 or docs[-1] != num_sequences:
            raise IndexedDatasetError(
                f"{path}: document index must run from 0 to the sequence count "
                f"{num_sequences}; the file is corrupt"
            )
        if num_documents > 1 and np.any(np.diff(docs) < 0):
            raise IndexedDatasetError(f"{path}: document index is not increasing; corrupt file")
        if num_sequences and np.any(self.sequence_lengths < 0):
            raise IndexedDatasetError(f"{path}: negative sequence length; corrupt file")

    def _open_data(self, path: str) -> None:
        itemsize = self.dtype.itemsize
        bin_size = os.path.getsize(path)
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        expected = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
        if bin_size != expected:
            raise IndexedDatasetError(
                f"{path}: {bin_size} bytes, but {index_file(self.prefix)} describes {expected}; "
                "the .bin and .idx do not belong together or one is truncated"
            )
        if len(lengths) > 1:
            steps = np.diff(pointers) != lengths[:-1].astype(np.int64) * itemsize
            if pointers[0] != 0 or np.any(steps):
                raise IndexedDatasetError(
                    f"{index_file(self.prefix)}: sequence offsets do not match their lengths"
                )
        self._bin_file = open(path, "rb")  # noqa: SIM115 - closed in close()
        if bin_size:
            self._bin_buffer = mmap.mmap(self._bin_file.fileno(), 0, access=mmap.ACCESS_READ)
        else:
            self._bin_buffer = b""

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i, as a read-only view."""
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {i} of {size}")
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_buffer, self.dtype, length, start)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def close(self) -> None:
        for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
            self.__dict__.pop(name, None)
        for name in ("_index_buffer", "_bin_buffer"):
            buffer = self.__dict__.pop(name, None)
            if isinstance(buffer, mmap.mmap):
                try:
                    buffer.close()
                except BufferError:  # views handed out are still alive; the GC unmaps it later
                    pass
        for name in ("_idx_file", "_bin_file"):
            handle = self.__dict__.pop(name, None)
            if handle is not None:
                handle.close()

    def __del__(self) -> None:
        try:
            self.close()
        except AttributeError:  # __init__ failed before the files were opened
            pass
