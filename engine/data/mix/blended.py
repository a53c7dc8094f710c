"""Weighted mixtures of datasets: `--data-path 0.7 prefixA 0.3 prefixB`, or `--data-path A B`.

Read as Megatron-LM reads them: weight/prefix pairs blend by weight; a list of prefixes alone
blends one epoch of each, weighted by its number of samples. A prefix may carry a short name,
`web:PREFIX`, under which its loss is logged (by default the prefix's file name).

Global sample i comes from dataset `dataset_index[i]`, as its `dataset_sample_index[i]`-th
sample. The assignment is megatron-core's greedy rule (csrc/dataset_helpers.cpp): each
dataset's count stays within one sample of weight * i for every prefix of the order, so the
same weights give the same order as Megatron-LM's BlendedDataset.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from engine.data.indexed.helpers import build_blending_indices
from engine.errors import ConfigError


@dataclass(frozen=True)
class Blend:
    """Dataset prefixes (or Parquet sources) and their weights as given; weights None when
    only prefixes were given."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None
    names: tuple[str, ...] = ()  # one short name per prefix (for per-dataset losses)


# `name:prefix`: a short name (letters, digits, _ . -, starting with a letter) before a colon
_NAMED = re.compile(r"^([A-Za-z][\w.-]*):(.+)$")


def _named(entries: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(prefixes, names) of `name:prefix` or plain prefix entries; a plain prefix is named by
    its file name without Megatron-LM's `_text_document` ending, made unique by a suffix."""
    prefixes, names = [], []
    for entry in entries:
        found = _NAMED.match(entry)
        prefix = found.group(2) if found else entry
        name = found.group(1) if found else os.path.basename(prefix.rstrip("/")) or prefix
        if not found:
            name = name.removesuffix("_text_document") or name
        prefixes.append(prefix)
        names.append(name)
    explicit = [found.group(1) for e in entries if (found := _NAMED.match(e))]
    repeated = sorted({n for n in explicit if explicit.count(n) > 1})
    if repeated:
        raise ConfigError(
            f"--data-path names {repeated[0]!r} twice; give each dataset of a blend its own name"
        )
    unique: list[str] = []
    for name in names:
        candidate, k = name, 1
        while candidate in unique or (candidate != name and candidate in names):
            k += 1
            candidate = f"{name}_{k}"
        unique.append(candidate)
    return tuple(prefixes), tuple(unique)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(data_path: list[str], flag: str = "--data-path") -> Blend:
    """['p'], ['p1', 'p2', ...] or ['0.7', 'pA', '0.3', 'pB'] -> Blend."""
    if not data_path:
        raise ConfigError(f"{flag} is empty; give a dataset prefix or weight/prefix pairs")
    weights = [_number(w) for w in data_path[::2]]
    if len(data_path) % 2 == 0 and all(w is not None for w in weights):
        prefixes, names = _named(data_path[1::2])
        for weight, prefix in zip(weights, prefixes, strict=False):
            if weight < 0:
                raise ConfigError(f"{flag}: weight {weight:g} of {prefix} is negative")
        if sum(weights) <= 0:
            raise ConfigError(f"{flag}: the weights are all zero")
        return Blend(prefixes, tuple(weights), names)
    if any(w is not None for w in weights):
        raise ConfigError(
            f"{flag} {' '.join(data_path)}: mixes weights and prefixes; give weight/prefix "
            "pairs (0.7 prefixA 0.3 prefixB) or prefixes alone (prefixA prefixB)"
        )
    prefixes, names = _named(data_path)
    return Blend(prefixes, None, names)


def normalize_weights(weights) -> list[float]:
    """Weights divided by their sum in float64, as megatron-core normalises them (the order
    depends on the last bit of each weight)."""
    array = np.asarray(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def parse_data_path(data_path: list[str]) -> tuple[list[float], list[str]]:
    """(normalised weights, prefixes); prefixes given alone weigh the same."""
    blend = parse_blend(data_path)
    weights = blend.weights or [1.0] * len(blend.prefixes)
    return normalize_weights(weights), list(blend.prefixes)


class BlendedDataset:
    """`size` samples drawn from `datasets` in the proportions of `weights` (normalised here,
    as megatron-core's BlendedDataset does); `names`: one short name per dataset. `indices`
    (dataset of each sample, its index there) replaces the one-weight order, for weights that
    change over training (engine/data/mix/schedule.py)."""

    def __init__(
        self,
        datasets: list,
        weights: list[float],
        size: int,
        split_name: str = "",
        names: tuple[str, ...] | list[str] = (),
        indices: tuple[np.ndarray, np.ndarray] | None = None,
    ):
        self.datasets = datasets
        self.names = tuple(names) or tuple(f"dataset{d}" for d in range(len(datasets)))
        self.weights = normalize_weights(weights)
        if indices is None:
            indices = build_blending_indices(self.weights, size)
        self.dataset_index, self.dataset_sample_index = indices
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, dataset in enumerate(datasets):
            if counts[d] > len(dataset):
                raise ConfigError(
                    f"the {split_name or 'blended'} split needs {counts[d]} samples of dataset "
                    f"{d} of its blend, which holds {len(dataset)}; give it a smaller weight"
                )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[self.dataset_index[i]][int(self.dataset_sample_index[i])]

    def consumed_per_dataset(self, consumed: int) -> np.ndarray:
        """How many of the first `consumed` samples each dataset gave."""
        head = self.dataset_index[: min(consumed, len(self.dataset_index))]
        return np.bincount(head, minlength=len(self.datasets))

    def domain(self, i: int) -> int:
        """The index (in `datasets` and `names`) of the dataset sample i comes from."""
        return int(self.dataset_index[i])
