"""The .bin/.idx format: round trips, the header byte by byte, Megatron-LM interoperability,
and clear errors for corrupt files."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest

from engine.data.indexed.dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    optimal_dtype,
)


def _write(prefix, documents, dtype=np.uint16):
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for doc in documents:
            builder.add_document(doc)
        builder.finalize()


def test_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, rng.integers(1, 300)) for _ in range(50)]
    _write(tmp_path / "a", docs)
    ds = IndexedDataset(tmp_path / "a")
    assert len(ds) == 50 and ds.num_documents == 50 and ds.dtype == np.uint16
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
        if len(doc) >= 4:
            np.testing.assert_array_equal(ds.get(i, 1, 3), doc[1:4])
    assert ds.num_tokens == sum(len(d) for d in docs)
    with pytest.raises(IndexError):
        ds.get(0, 0, len(docs[0]) + 1)


def test_bulk_add_equals_one_by_one(tmp_path):
    docs = [np.arange(n, dtype=np.int64) for n in (3, 1, 7)]
    _write(tmp_path / "one", docs, np.int32)
    with IndexedDatasetBuilder(tmp_path / "bulk", np.int32) as builder:
        builder.add_sequences(np.concatenate(docs), np.array([3, 1, 7]))
        builder.finalize()
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"bulk{suffix}").read_bytes()


def test_header_field_by_field(tmp_path):
    _write(tmp_path / "h", [[1, 2, 3], [4], [5, 6]], np.uint16)
    raw = (tmp_path / "h.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)  # version
    assert struct.unpack("<B", raw[17:18]) == (8,)  # uint16 dtype code
    assert struct.unpack("<Q", raw[18:26]) == (3,)  # sequences
    assert struct.unpack("<Q", raw[26:34]) == (4,)  # document index entries
    off = 34
    assert struct.unpack("<3i", raw[off : off + 12]) == (3, 1, 2)  # lengths
    off += 12
    assert struct.unpack("<3q", raw[off : off + 24]) == (0, 6, 8)  # byte pointers
    off += 24
    assert struct.unpack("<4q", raw[off : off + 32]) == (0, 1, 2, 3)  # document index
    assert len(raw) == off + 32
    assert (tmp_path / "h.bin").read_bytes() == np.array([1, 2, 3, 4, 5, 6], "<u2").tobytes()


def test_dtype_choice():
    assert optimal_dtype(32000) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(128256) == np.int32


def _megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def test_megatron_reads_ours(dataset_prefix):
    megatron = _megatron()
    ours = IndexedDataset(dataset_prefix)
    theirs = megatron.IndexedDataset(dataset_prefix)
    assert len(theirs) == len(ours)
    np.testing.assert_array_equal(theirs.document_indices, ours.document_indices)
    np.testing.assert_array_equal(theirs.sequence_lengths, ours.sequence_lengths)
    for i in (0, len(ours) // 2, len(ours) - 1):
        np.testing.assert_array_equal(theirs[i], ours[i])


def test_we_read_megatrons(tmp_path):
    megatron = _megatron()
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 100000, rng.integers(1, 50)).astype(np.int32) for _ in range(20)]
    builder = megatron.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    import torch

    for doc in docs:
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    ours = IndexedDataset(tmp_path / "m")
    assert ours.dtype == np.int32
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ours[i], doc)
    # ... and writing the same documents ourselves gives the same bytes.
    _write(tmp_path / "o", docs, np.int32)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"o{suffix}").read_bytes() == (tmp_path / f"m{suffix}").read_bytes()


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda idx, b: idx.write_bytes(b"NOTMAGIC" + idx.read_bytes()[8:]), "bad magic"),
        (lambda idx, b: idx.write_bytes(idx.read_bytes()[:20]), "truncated header"),
        (lambda idx, b: idx.write_bytes(idx.read_bytes()[:-8]), "truncated or corrupt"),
        (lambda idx, b: b.write_bytes(b.read_bytes()[:-2]), "do not belong together"),
        (
            lambda idx, b: idx.write_bytes(
                idx.read_bytes()[:9] + struct.pack("<Q", 2) + idx.read_bytes()[17:]
            ),
            "version 2",
        ),
        (
            lambda idx, b: idx.write_bytes(
                idx.read_bytes()[:17] + struct.pack("<B", 99) + idx.read_bytes()[18:]
            ),
            "dtype code 99",
        ),
    ],
)
def test_corrupt_files_name_the_file_and_problem(tmp_path, corrupt, message):
    _write(tmp_path / "c", [[1, 2, 3], [4, 5]])
    corrupt(tmp_path / "c.idx", tmp_path / "c.bin")
    with pytest.raises(IndexedDatasetError, match=message) as info:
        IndexedDataset(tmp_path / "c")
    assert str(tmp_path / "c") in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(IndexedDatasetError, match="no such file"):
        IndexedDataset(tmp_path / "nothing")


def test_builder_abort_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(tmp_path / "x", np.uint16) as builder:
        builder.add_document([1, 2])
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_merge(tmp_path):
    from tools.merge_datasets import main

    _write(tmp_path / "a", [[1, 2], [3]])
    _write(tmp_path / "b", [[4, 5, 6]])
    assert (
        main(
            [
                "--input",
                str(tmp_path / "a"),
                str(tmp_path / "b"),
                "--output-prefix",
                str(tmp_path / "ab"),
            ]
        )
        == 0
    )
    merged = IndexedDataset(tmp_path / "ab")
    assert [merged[i].tolist() for i in range(len(merged))] == [[1, 2], [3], [4, 5, 6]]
    np.testing.assert_array_equal(merged.document_indices, [0, 1, 2, 3])
