"""GPT training samples: documents packed into fixed-length samples, shuffled and split,
sample for sample as megatron-core's GPTDataset (tested against it).

For one split (a contiguous range of the dataset's sequences, which preprocess_data.py writes
one per document) and a requested number of samples:

- epochs: as few as give num_samples samples of seq_length + 1 tokens;
- doc_index: the split's sequences repeated once per epoch and shuffled together by a
  numpy RandomState(seed); when the last epoch would supply under 80% of an epoch's samples,
  it is shuffled apart and appended, so that its few samples do not mix into the others;
- sample_index: where each sample of seq_length + 1 tokens starts in that stream (built by the
  C++ helper in csrc/, see engine/data/indexed/helpers.py); consecutive samples overlap by one
  token, so each token is predicted exactly once per epoch;
- shuffle_index: a permutation of all samples by the same RandomState (the separated last
  epoch's samples again shuffled apart, after the others).

The three arrays are cached as .npy files beside the data under a name that hashes every
parameter they depend on, so a second start loads them instantly and a changed parameter
(or re-tokenized data) never reuses a stale cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass

import numpy as np

from engine.data.indexed.dataset import IndexedDataset, index_file
from engine.data.indexed.helpers import build_sample_index
from engine.errors import ConfigError

log = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
CACHE_VERSION = 2  # 2: megatron-core's order
# A last epoch that supplies fewer than this share of an epoch's samples is shuffled apart.
SEPARATE_LAST_EPOCH_BELOW = 0.80


def parse_split(split: str) -> list[float]:
    """'969,30,1' -> normalised weights for train/valid/test (missing trailing parts are 0).

    As in Megatron-LM, the numbers are read out of the text whatever commas, slashes, spaces or
    quotes surround them, so "'99,1,0'" (quotes kept by a script's word splitting) and 99/1/0
    both work; unlike it, a minus sign is kept, so that a negative weight is an error rather
    than positive."""
    try:
        parts = [float(p) for p in re.findall(r"-?[.0-9]+", split)]
    except ValueError:
        raise ConfigError(f"--split {split!r}: expected numbers like 969,30,1") from None
    if not parts or len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"--split {split!r}: expected up to 3 non-negative weights, not all 0")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_bookends(weights: list[float]) -> list[tuple[float, float] | None]:
    """Each split's [start, end) as shares of the dataset (cumulative sums of the normalised
    weights, as megatron-core adds them); None for a split of weight zero."""
    bounds = [0.0]
    for weight in weights:
        bounds.append(bounds[-1] + weight)
    return [(bounds[k], bounds[k + 1]) if weights[k] > 0 else None for k in range(len(weights))]


def sequence_range(num_sequences: int, bookends: tuple[float, float]) -> tuple[int, int]:
    """A split's [start, end) of a dataset's sequences: each share times the count, rounded
    (halves to even) as megatron-core rounds them."""
    start, end = (int(round(b * float(num_sequences))) for b in bookends)
    return start, end


def split_ranges(num_sequences: int, weights: list[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) sequence ranges for train/valid/test (empty for a split of
    weight zero)."""
    return [sequence_range(num_sequences, b) if b else (0, 0) for b in split_bookends(weights)]


@dataclass(frozen=True)
class GPTDatasetSpec:
    """Everything a split's index arrays depend on (hashed into the cache name)."""

    prefix: str
    split_name: str
    sequence_range: tuple[int, int]
    num_samples: int | None
    seq_length: int
    seed: int


class GPTDataset:
    """Packed, shuffled samples of seq_length + 1 token ids from one split of a dataset."""

    def __init__(
        self,
        indexed: IndexedDataset,
        spec: GPTDatasetSpec,
        cache_dir: str | None = None,
        cache: bool = True,
    ):
        """`cache` False keeps the index arrays in memory only (generated data has no folder
        of its own to cache them beside)."""
        self.indexed = indexed
        self.spec = spec
        start, end = spec.sequence_range
        if end <= start:
            raise ConfigError(
                f"{spec.prefix}: the {spec.split_name} split holds none of its documents; "
                "raise that split's share (--split) or leave this dataset out of the blend"
            )
        self.sequences = np.arange(start, end, dtype=np.int32)
        self.tokens_per_epoch = int(indexed.sequence_lengths[self.sequences].sum(dtype=np.int64))
        if self.tokens_per_epoch < 1:
            raise ConfigError(
                f"{spec.prefix}: the {spec.split_name} split holds no tokens; give it more "
                "documents (--split)"
            )
        self.num_epochs = self._epochs_needed()
        self.doc_index, self.sample_index, self.shuffle_index = (
            self._load_or_build(cache_dir) if cache else self._build()
        )
        self._lengths = indexed.sequence_lengths

    def _epochs_needed(self) -> int:
        wanted, seq = self.spec.num_samples, self.spec.seq_length
        if wanted is None:
            return 1
        epochs = 1
        while (epochs * self.tokens_per_epoch - 1) // seq < wanted:
            epochs += 1
        return epochs

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, idx: int) -> np.ndarray:
        """Sample idx: seq_length + 1 token ids (int64)."""
        i = int(self.shuffle_index[idx])
        (first, offset), (last, end_offset) = self.sample_index[i : i + 2].tolist()
        get, doc_index = self.indexed.get, self.doc_index
        if first == last:
            return get(int(doc_index[first]), offset, end_offset - offset + 1).astype(np.int64)
        parts = [get(int(doc_index[first]), offset)]
        parts.extend(get(int(doc_index[k])) for k in range(first + 1, last))
        parts.append(get(int(doc_index[last]), 0, end_offset + 1))
        return np.concatenate(parts).astype(np.int64, copy=False)

    # --- index arrays -------------------------------------------------------------------

    def _description(self) -> dict:
        lengths = self.indexed.sequence_lengths
        return {
            "class": "GPTDataset",
            "cache_version": CACHE_VERSION,
            "prefix": os.path.abspath(self.spec.prefix),
            "split": self.spec.split_name,
            "sequence_range": list(self.spec.sequence_range),
            "num_samples": self.spec.num_samples,
            "seq_length": self.spec.seq_length,
            "seed": self.spec.seed,
            "num_epochs": self.num_epochs,
            "num_sequences": len(lengths),
            "sequence_lengths_sha1": hashlib.sha1(lengths.tobytes()).hexdigest(),
        }

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        seq, epochs, tokens = self.spec.seq_length, self.num_epochs, self.tokens_per_epoch
        num_samples = (epochs * tokens - 1) // seq
        before_last = (((epochs - 1) * tokens - 1) // seq) if epochs > 1 else 0
        separate = epochs > 1 and (self.spec.num_samples - before_last) < int(
            SEPARATE_LAST_EPOCH_BELOW * ((tokens - 1) // seq)
        )
        rng = np.random.RandomState(self.spec.seed)
        if separate:
            doc_index = np.concatenate(
                [
                    _shuffled_epochs(self.sequences, epochs - 1, rng),
                    _shuffled_epochs(self.sequences, 1, rng),
                ]
            )
        else:
            doc_index = _shuffled_epochs(self.sequences, epochs, rng)
        sample_index = build_sample_index(
            self.indexed.sequence_lengths, doc_index, seq, num_samples
        )
        dtype = np.uint32 if num_samples < 2**32 - 2 else np.int64
        first = np.arange(before_last if separate else num_samples, dtype=dtype)
        rng.shuffle(first)
        if not separate:
            return doc_index, sample_index, first
        last = np.arange(before_last, num_samples, dtype=dtype)
        rng.shuffle(last)
        return doc_index, sample_index, np.concatenate([first, last])

    def cache_paths(self, cache_dir: str | None) -> dict[str, str]:
        description = json.dumps(self._description(), sort_keys=True)
        digest = hashlib.md5(description.encode()).hexdigest()
        directory = cache_dir or os.path.join(
            os.path.dirname(index_file(self.spec.prefix)), "cache"
        )
        stem = os.path.join(
            directory, f"{os.path.basename(self.spec.prefix)}-{self.spec.split_name}-{digest}"
        )
        names = ("description", "doc_index", "sample_index", "shuffle_index")
        return {n: f"{stem}-{n}.{'json' if n == 'description' else 'npy'}" for n in names}

    def _load_or_build(self, cache_dir: str | None):
        paths = self.cache_paths(cache_dir)
        arrays = ("doc_index", "sample_index", "shuffle_index")
        if all(os.path.isfile(paths[n]) for n in arrays):
            return tuple(np.load(paths[n], mmap_mode="r") for n in arrays)
        built = self._build()
        try:
            os.makedirs(os.path.dirname(paths["doc_index"]), exist_ok=True)
            for name, array in zip(arrays, built, strict=False):
                _save_atomically(paths[name], array)
            tmp = f"{paths['description']}.tmp.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self._description(), f, indent=1, sort_keys=True)
            os.replace(tmp, paths["description"])
        except OSError as err:
            log.warning(
                "could not cache dataset indices in %s (%s); keeping them in memory",
                os.path.dirname(paths["doc_index"]),
                err,
            )
        return built


def _shuffled_epochs(sequences: np.ndarray, epochs: int, rng: np.random.RandomState):
    """The sequences once per epoch, all epochs shuffled together (int32, as megatron-core)."""
    index = np.tile(sequences, epochs).astype(np.int32)
    rng.shuffle(index)
    return index


def _save_atomically(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp.{os.getpid()}.npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)
