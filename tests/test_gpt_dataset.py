"""GPTDataset packing and shuffling, the C++ index builder against numpy, and the index cache."""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine.data.indexed.dataset import IndexedDataset, IndexedDatasetBuilder
from engine.data.indexed.gpt_dataset import GPTDataset, GPTDatasetSpec, parse_split, split_ranges
from engine.data.indexed.helpers import (
    build_sample_index,
    build_sample_index_numpy,
    native_available,
)
from engine.errors import ConfigError


def test_cpp_helper_is_built():
    assert native_available(), "pip install -e . should have built engine.data.indexed._helpers"


def test_cpp_sample_index_equals_numpy_on_random_inputs():
    rng = np.random.default_rng(0)
    for trial in range(200):
        num_docs = int(rng.integers(1, 40))
        sizes = rng.integers(0, 30, num_docs).astype(np.int32)
        if trial % 3 == 0:
            sizes[rng.integers(0, num_docs, 3)] = 0  # empty documents
        if sizes.sum() < 2:
            sizes[0] = 2
        doc_index = rng.permutation(np.repeat(np.arange(num_docs), rng.integers(1, 4)))
        seq = int(rng.integers(1, 20))
        total = int(sizes[doc_index].sum())
        num_samples = (total - 1) // seq
        expected = build_sample_index_numpy(sizes, doc_index, seq, num_samples)
        np.testing.assert_array_equal(
            build_sample_index(sizes, doc_index, seq, num_samples), expected
        )
        assert np.all(expected[:, 1] < sizes[doc_index[expected[:, 0]]])
    with pytest.raises(ValueError, match="fewer tokens"):
        build_sample_index(np.array([5], np.int32), np.array([0]), 5, 1)


def _dataset(tmp_path, docs, seq, num_samples=None, seed=3, cache=True):
    prefix = tmp_path / "d"
    if not (tmp_path / "d.idx").exists():
        with IndexedDatasetBuilder(prefix, np.int32) as builder:
            for doc in docs:
                builder.add_document(doc)
            builder.finalize()
    indexed = IndexedDataset(prefix)
    spec = GPTDatasetSpec(str(prefix), "train", (0, len(docs)), num_samples, seq, seed)
    return GPTDataset(indexed, spec, str(tmp_path / "cache") if cache else None)


def test_every_token_once_per_epoch_in_order(tmp_path):
    rng = np.random.default_rng(1)
    eod = -1
    docs = [np.append(rng.integers(0, 1000, rng.integers(1, 40)), eod) for _ in range(30)]
    seq = 16
    ds = _dataset(tmp_path, docs, seq, num_samples=200)
    assert ds.num_epochs > 1
    # Undo the sample shuffle, then the stream read back must be the documents end to end in
    # the document order: every token once per epoch, EODs where they were.
    order = np.argsort(np.asarray(ds.shuffle_index))
    samples = [ds[int(i)] for i in order]
    assert all(len(s) == seq + 1 for s in samples)
    for a, b in zip(samples, samples[1:], strict=False):
        assert a[-1] == b[0]  # consecutive samples share one token
    stream = np.concatenate([s[:-1] for s in samples] + [samples[-1][-1:]])
    expected = np.concatenate([docs[d] for d in ds.doc_index])
    np.testing.assert_array_equal(stream, expected[: len(stream)])
    # As in megatron-core, the epochs are shuffled together: each document once per epoch.
    counts = np.bincount(np.asarray(ds.doc_index), minlength=len(docs))
    assert counts.tolist() == [ds.num_epochs] * len(docs)
    assert not np.array_equal(ds.doc_index, np.sort(ds.doc_index))


def test_shuffle_is_deterministic_by_seed(tmp_path):
    docs = [np.arange(i, i + 20) for i in range(10)]
    a = _dataset(tmp_path, docs, 8, 40, seed=5, cache=False)
    b = _dataset(tmp_path, docs, 8, 40, seed=5, cache=False)
    c = _dataset(tmp_path, docs, 8, 40, seed=6, cache=False)
    assert all(np.array_equal(a[i], b[i]) for i in range(40))
    assert not all(np.array_equal(a[i], c[i]) for i in range(40))


def test_cache_is_reused_and_invalidated(tmp_path):
    docs = [np.arange(i, i + 20) for i in range(10)]
    first = _dataset(tmp_path, docs, 8, 40)
    paths = first.cache_paths(str(tmp_path / "cache"))
    assert all(os.path.exists(p) for p in paths.values())
    stamp = os.stat(paths["sample_index"]).st_mtime_ns
    again = _dataset(tmp_path, docs, 8, 40)
    assert isinstance(again.sample_index, np.memmap)  # loaded, not rebuilt
    assert os.stat(paths["sample_index"]).st_mtime_ns == stamp
    for change in ({"seq": 7}, {"seed": 9}, {"num_samples": 80}):
        kwargs = {"seq": 8, "num_samples": 40, "seed": 3} | change
        other = _dataset(tmp_path, docs, **kwargs)
        assert other.cache_paths(str(tmp_path / "cache"))["sample_index"] != paths["sample_index"]
    # Re-tokenized data (different lengths) under the same prefix gets a different cache too.
    for suffix in (".bin", ".idx"):
        os.remove(tmp_path / f"d{suffix}")
    changed = _dataset(tmp_path, [np.arange(25)] * 10, 8, 40)
    assert changed.cache_paths(str(tmp_path / "cache"))["sample_index"] != paths["sample_index"]


def test_split_by_documents():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("8,2") == pytest.approx([0.8, 0.2, 0.0])
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    # megatron-core rounds each cumulative share; 573 documents keep their last for testing
    assert split_ranges(573, parse_split("949,50,1")) == [(0, 544), (544, 572), (572, 573)]
    assert split_ranges(10, parse_split("1,1,1")) == [(0, 3), (3, 7), (7, 10)]  # as Megatron
    for bad in ("a,b", "-1,2", "0,0,0", "1,1,1,1", "1.2.3"):
        with pytest.raises(ConfigError, match="--split"):
            parse_split(bad)


def test_split_is_read_as_megatron_reads_it():
    """Quotes that a script's word splitting leaves in place, and other separators."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    for text in ("'99,1,0'", '"949,50,1"', "99/1/0", "98, 2", "1"):
        assert parse_split(text) == pytest.approx(parse_and_normalize_split(text)), text


def test_a_split_shorter_than_a_sample_repeats_and_an_empty_one_is_an_error(tmp_path):
    few = _dataset(tmp_path, [np.arange(5)], seq=16, num_samples=3, cache=False)
    assert few.num_epochs == 10 and len(few) == 3  # as megatron-core: epochs until 3 * 16 + 1
    np.testing.assert_array_equal(few[0], np.tile(np.arange(5), 4)[:17])
    with pytest.raises(ConfigError, match="holds no tokens"):
        _dataset(tmp_path / "empty", [np.arange(0)], seq=16, num_samples=1)


def test_real_corpus_samples(dataset_prefix, tmp_path):
    indexed = IndexedDataset(dataset_prefix)
    spec = GPTDatasetSpec(dataset_prefix, "train", (0, len(indexed.sequence_lengths)), 500, 256, 1)
    ds = GPTDataset(indexed, spec, str(tmp_path))
    assert len(ds) >= 500
    sample = ds[0]
    assert sample.dtype == np.int64 and sample.shape == (257,)
