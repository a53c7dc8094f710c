"""Sample-index and blending-index builders.

The C++ versions in csrc/dataset_helpers.cpp are used when the extension is built (it is, by
`pip install -e .`); the numpy versions here are the readable reference the tests compare them
with, and the fallback when the extension is missing.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

try:
    from engine.data.indexed import _helpers as _cpp
except ImportError:  # pragma: no cover - exercised only on a broken install
    _cpp = None
    log.warning("engine.data.indexed._helpers is not built; using the slower numpy index builders")


def build_sample_index_numpy(
    sizes: np.ndarray, doc_index: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """Reference: start (doc_index position, offset) of each packed sample, vectorised.

    Sample i starts at stream position i * seq_length of the documents laid end to end in
    doc_index order; see csrc/dataset_helpers.cpp for the exact contract.
    """
    lengths = np.asarray(sizes, dtype=np.int64)[np.asarray(doc_index, dtype=np.int64)]
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    if num_samples * seq_length >= total:
        raise ValueError("the documents hold fewer tokens than num_samples * seq_length + 1")
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - lengths[position])
    return np.stack([position, offset], axis=1).astype(np.int64)


def build_blending_indices_numpy(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference: greedy assignment of `size` global samples to datasets by normalised weight
    (sample i goes where weight * max(i, 1) - count is largest, first on ties)."""
    share = np.asarray(weights, dtype=np.float64)
    count = np.zeros(len(share), dtype=np.int64)
    which = np.empty(size, dtype=np.int16)
    nth = np.empty(size, dtype=np.int64)
    for i in range(size):
        best = int(np.argmax(share * max(i, 1) - count))
        which[i] = best
        nth[i] = count[best]
        count[best] += 1
    return which, nth


def build_sample_index(sizes, doc_index, seq_length: int, num_samples: int) -> np.ndarray:
    """Start of every packed sample; C++ when built, else the numpy reference."""
    if _cpp is None:
        return build_sample_index_numpy(sizes, doc_index, seq_length, num_samples)
    try:
        return _cpp.build_sample_index(
            np.asarray(sizes, dtype=np.int32),
            np.asarray(doc_index, dtype=np.int64),
            int(seq_length),
            int(num_samples),
        )
    except IndexError as err:  # pybind11 maps std::out_of_range to IndexError
        raise ValueError(str(err)) from err


def build_blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index, sample index inside that dataset) for each of `size` samples; `weights`
    normalised to sum to one (see normalize_weights in engine.data.mix.blended)."""
    if _cpp is None:
        return build_blending_indices_numpy(weights, size)
    return _cpp.build_blending_indices(np.asarray(weights, dtype=np.float64), int(size))


def native_available() -> bool:
    """Whether the C++ builders are in use."""
    return _cpp is not None
