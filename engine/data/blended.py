"""Weighted mixtures of datasets: `--data-path 0.7 prefixA 0.3 prefixB`.

Global sample i comes from dataset `dataset_index[i]`, as its `dataset_sample_index[i]`-th
sample. The assignment is greedy (csrc/dataset_helpers.cpp): each dataset's count stays within
one sample of weight * i for every prefix of the order, so any window of 1,000 consecutive
samples matches the weights to within 0.2 percentage points.
"""

from __future__ import annotations

import numpy as np

from engine.data.helpers import build_blending_indices
from engine.errors import ConfigError


def parse_data_path(data_path: list[str]) -> tuple[list[float], list[str]]:
    """['prefix'] or ['0.7', 'prefixA', '0.3', 'prefixB'] -> (weights, prefixes)."""
    if not data_path:
        raise ConfigError("--data-path is empty; give a dataset prefix or weight/prefix pairs")
    if len(data_path) == 1:
        return [1.0], list(data_path)
    if len(data_path) % 2:
        raise ConfigError(
            f"--data-path {' '.join(data_path)}: expected weight/prefix pairs "
            "(e.g. 0.7 prefixA 0.3 prefixB)"
        )
    weights, prefixes = [], []
    for weight, prefix in zip(data_path[::2], data_path[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise ConfigError(
                f"--data-path: {weight!r} is not a weight (before {prefix})"
            ) from None
        if value < 0:
            raise ConfigError(f"--data-path: weight {weight} of {prefix} is negative")
        weights.append(value)
        prefixes.append(prefix)
    if sum(weights) <= 0:
        raise ConfigError("--data-path: the weights are all zero")
    total = sum(weights)
    return [w / total for w in weights], prefixes


def blend_counts(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blending indices for `size` samples and how many samples each dataset must supply."""
    which, nth = build_blending_indices(weights, size)
    counts = np.bincount(which, minlength=len(weights)) if size else np.zeros(len(weights), int)
    return which, nth, counts


class BlendedDataset:
    """`size` samples drawn from `datasets` in the proportions of `weights`."""

    def __init__(self, datasets: list, weights: list[float], size: int, which=None, nth=None):
        if which is None or nth is None:
            which, nth, _ = blend_counts(weights, size)
        self.datasets = datasets
        self.weights = weights
        self.dataset_index = which
        self.dataset_sample_index = nth
        for d, dataset in enumerate(datasets):
            needed = int(np.count_nonzero(which == d))
            if needed > len(dataset):
                raise ConfigError(f"dataset {d} supplies {len(dataset)} samples, {needed} needed")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[self.dataset_index[i]][int(self.dataset_sample_index[i])]
