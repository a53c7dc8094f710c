"""Blending by weight, data-path parsing, and the resumable DP-aware sampler."""

from __future__ import annotations

import numpy as np
import pytest

from engine.data.builder import build_gpt_datasets
from engine.data.indexed.dataset import IndexedDatasetBuilder
from engine.data.indexed.helpers import build_blending_indices, build_blending_indices_numpy
from engine.data.loader import PretrainingSampler, build_data_iterator
from engine.data.mix.blended import BlendedDataset, parse_blend, parse_data_path
from engine.data.sources import data_sources
from engine.errors import ConfigError


def test_cpp_blending_equals_numpy():
    rng = np.random.default_rng(0)
    for _ in range(20):
        weights = rng.random(int(rng.integers(1, 6)))
        size = int(rng.integers(0, 3000))
        a, b = build_blending_indices(weights, size)
        c, d = build_blending_indices_numpy(weights, size)
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)


def test_every_window_of_1000_tracks_the_weights():
    weights = [0.7, 0.2, 0.1]
    which, nth = build_blending_indices(weights, 50_000)
    onehot = np.eye(3)[which]
    sums = np.cumsum(np.vstack([np.zeros(3), onehot]), axis=0)
    window = (sums[1000:] - sums[:-1000]) / 1000  # share in every window of 1,000
    assert np.abs(window - np.array(weights)).max() <= 0.01
    for d in range(3):  # each dataset's samples are taken in order 0, 1, 2, ...
        np.testing.assert_array_equal(nth[which == d], np.arange((which == d).sum()))


def test_parse_data_path():
    assert parse_data_path(["p"]) == ([1.0], ["p"])
    assert parse_data_path(["3", "a", "1", "b"]) == ([0.75, 0.25], ["a", "b"])
    for bad in (["1", "a", "2"], ["x", "a", "1", "b"], ["-1", "a", "1", "b"], []):
        with pytest.raises(ConfigError, match="--data-path"):
            parse_data_path(bad)


def test_data_path_is_read_as_megatron_reads_it():
    from megatron.core.datasets.utils import get_blend_from_list

    for path in (["p"], ["a", "b"], ["a", "b", "c"], ["3", "a", "1", "b"], ["1.0", "a"]):
        prefixes, weights = get_blend_from_list(path)
        blend = parse_blend(path)
        assert list(blend.prefixes) == prefixes, path
        assert (list(blend.weights) if blend.weights else None) == weights, path


def test_a_blend_split_empty_in_one_dataset_is_one_line(dataset_prefix, tmp_path):
    """megatron-core stops on an assertion here; we name the dataset and split."""
    small = tmp_path / "small"
    with IndexedDatasetBuilder(small, np.int32) as builder:
        for doc in range(20):
            builder.add_document(np.arange(doc, doc + 30))
        builder.finalize()
    with pytest.raises(ConfigError, match="small: the test split holds none of its documents"):
        sources = data_sources([dataset_prefix, str(small)], "90,9,1")
        build_gpt_datasets(sources, 16, 1, (8, 8, 8), str(tmp_path))


def test_blend_of_two_real_datasets(dataset_prefix, tmp_path):
    train, valid, test = build_gpt_datasets(
        data_sources(["0.7", dataset_prefix, "0.3", dataset_prefix], "90,10,0"),
        64,
        7,
        (2000, 100, 0),
        cache_dir=str(tmp_path),
    )
    assert isinstance(train, BlendedDataset) and len(train) == 2000 and test is None
    share = np.bincount(train.dataset_index) / len(train)
    assert share == pytest.approx([0.7, 0.3], abs=0.001)
    assert len(valid) == 100 and train[0].shape == (65,)


def test_sample_k_does_not_depend_on_dp_size():
    total, mbs, global_batch = 96, 2, 16

    def global_order(dp):
        per_rank = [list(PretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
        order = []
        for step in range(len(per_rank[0])):
            for r in range(dp):
                order.extend(per_rank[r][step])
        return order

    assert global_order(1) == global_order(2) == global_order(4) == list(range(total))
    # Resuming mid-run (after 3 global batches), under another DP size, continues exactly.
    resumed = [PretrainingSampler(total, 3 * global_batch, mbs, r, 4) for r in range(4)]
    assert list(resumed[1])[0] == [3 * global_batch + 2, 3 * global_batch + 3]


def test_data_iterator_shifts_labels(dataset_prefix, tmp_path):
    train, _, _ = build_gpt_datasets(
        data_sources([dataset_prefix], "1"), 32, 1, (8, 0, 0), str(tmp_path)
    )
    batch = next(build_data_iterator(train, 2, micro_batch_size=2, dp_rank=1, dp_size=2))
    assert batch["tokens"].shape == (2, 32) and batch["labels"].shape == (2, 32)
    sample = train[4]  # consumed 2, dp rank 1 of 2 with micro-batch 2 starts at sample 4
    assert batch["tokens"][0].tolist() == sample[:-1].tolist()
    assert batch["labels"][0].tolist() == sample[1:].tolist()
