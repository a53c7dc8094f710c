"""From the data sources (engine/data/sources.py) and the sample counts the run asks of
each split to the train, valid and test datasets."""

from __future__ import annotations

import functools
import math

from engine.config.tokenizer import TokenizerConfig
from engine.data.indexed.dataset import IndexedDataset
from engine.data.indexed.gpt_dataset import (
    SPLIT_NAMES,
    GPTDataset,
    GPTDatasetSpec,
    parse_split,
    sequence_range,
    split_ranges,
)
from engine.data.indexed.mock import MOCK_SPLIT, MockIndexedDataset
from engine.data.mix.blended import Blend, BlendedDataset, normalize_weights
from engine.data.sources import DataSources
from engine.data.streaming.dataset import StreamingDataset, StreamPlan
from engine.data.streaming.shards import open_shards
from engine.data.tokenizers import build_tokenizer
from engine.errors import ConfigError

# megatron-core builds each dataset of a weighted blend this much larger than its share, so
# that the blend never runs short (its mid_level_dataset_surplus default); the surplus changes
# how many epochs a dataset spans and so its shuffle, hence it is kept.
MID_LEVEL_SURPLUS = 0.005


def build_gpt_datasets(
    sources: DataSources,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    mix=None,
) -> list[BlendedDataset | None]:
    """[train, valid, test] of preprocessed `sources` (engine/data/sources.py), sample for
    sample as megatron-core's BlendedMegatronDatasetBuilder builds them for the same paths,
    split, seed, sequence length and sample counts.

    A split is None where it is asked for no samples, has no paths, or its share of the
    documents rounds to none in every dataset (e.g. a 0.1% test split of a small corpus).
    `mix` (engine/data/mix/schedule.py MixSchedule) sets the train split's order instead of
    its blend weights."""
    opened: dict[str, IndexedDataset] = {}

    def indexed(prefix: str) -> IndexedDataset:
        if prefix not in opened:
            opened[prefix] = IndexedDataset(prefix)
        return opened[prefix]

    blends, bookends = sources.blends, sources.shares
    result: list[BlendedDataset | None] = []
    for k, name in enumerate(SPLIT_NAMES):
        if num_samples[k] <= 0 or blends[k] is None or bookends[k] is None:
            result.append(None)
            continue
        ranges = {
            p: sequence_range(len(indexed(p).sequence_lengths), bookends[k])
            for p in blends[k].prefixes
        }
        if all(end <= start for start, end in ranges.values()):
            result.append(None)
            continue
        part = functools.partial(
            _part, indexed, ranges, name, seq_length=seq_length, seed=seed, cache_dir=cache_dir
        )
        # megatron-core takes a split's only prefix as it is when the split has paths of its
        # own, weighted or not
        direct = sources.per_split and len(blends[k].prefixes) == 1
        if k == 0 and mix is not None:
            result.append(_scheduled_split(blends[k], part, num_samples[k], name, mix))
            continue
        result.append(_blend_split(blends[k], part, num_samples[k], name, direct))
    return result


def _part(indexed, ranges, split_name, prefix, count, *, seq_length, seed, cache_dir):
    """The GPTDataset of one prefix's share of a split, `count` samples (None: one epoch)."""
    spec = GPTDatasetSpec(prefix, split_name, ranges[prefix], count, seq_length, seed)
    return GPTDataset(indexed(prefix), spec, cache_dir)


def _blend_split(blend: Blend, part, size: int, name: str, direct: bool) -> BlendedDataset:
    """One split as megatron-core composes it: one unweighted prefix (or `direct`) is its
    dataset itself; a weighted blend builds each dataset for its share plus the surplus;
    prefixes given alone give one epoch each, weighted by their sizes."""
    if (blend.weights is None or direct) and len(blend.prefixes) == 1:
        return BlendedDataset([part(blend.prefixes[0], size)], [1.0], size, name, blend.names)
    if blend.weights is None:
        parts = [part(prefix, None) for prefix in blend.prefixes]
        lengths = [len(p) for p in parts]
        for prefix, length in zip(blend.prefixes, lengths, strict=False):
            if length == 0:
                raise ConfigError(
                    f"{prefix}: its {name} split holds fewer than --seq-length + 1 tokens, so "
                    "one epoch of it (prefixes given alone) is no sample; give weights to "
                    "repeat it, or leave it out"
                )
        return BlendedDataset(parts, lengths, min(size, sum(lengths)), name, blend.names)
    kept = [
        (w, p, n)
        for w, p, n in zip(blend.weights, blend.prefixes, blend.names, strict=False)
        if w > 0
    ]
    weights = normalize_weights([w for w, _, _ in kept])
    targets = [math.ceil(size * w) for w in weights]
    parts = [
        part(prefix, math.ceil(target * (1 + MID_LEVEL_SURPLUS)))
        for target, (_, prefix, _) in zip(targets, kept, strict=False)
    ]
    return BlendedDataset(parts, weights, sum(targets), name, [n for _, _, n in kept])


def _scheduled_split(blend: Blend, part, size: int, name: str, mix) -> BlendedDataset:
    """The train split under a mix schedule. Every dataset is built for the whole split's
    samples plus megatron-core's surplus, whatever the schedule takes from it: its order
    (the epochs it spans decide its shuffle) then does not change with the schedule, so a
    phase that has not begun can change on resume without moving samples already read."""
    indices = mix.blending_indices(size)
    count = math.ceil(size * (1 + MID_LEVEL_SURPLUS))
    parts = [part(prefix, count) for prefix in blend.prefixes]
    weights = list(mix.phases[0].weights)
    return BlendedDataset(parts, weights, size, name, blend.names, indices=indices)


def build_mock_datasets(
    vocab_size: int,
    eod: int,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
) -> list[BlendedDataset | None]:
    """--mock-data: [train, valid, test] from generated documents, split 1:1:1 (as in
    Megatron-LM, whatever --split says). Index arrays are cached only under --data-cache-path."""
    mock = MockIndexedDataset(vocab_size, eod)
    ranges = split_ranges(len(mock.sequence_lengths), parse_split(MOCK_SPLIT))
    result: list[BlendedDataset | None] = []
    for k, name in enumerate(SPLIT_NAMES):
        if num_samples[k] <= 0:
            result.append(None)
            continue
        spec = GPTDatasetSpec(mock.prefix, name, ranges[k], num_samples[k], seq_length, seed)
        part = GPTDataset(mock, spec, cache_dir, cache=cache_dir is not None)
        result.append(BlendedDataset([part], [1.0], num_samples[k], name))
    return result


def build_streaming_datasets(
    sources: DataSources,
    text_column: str,
    shuffle_buffer: int,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    tokenizer: TokenizerConfig,
) -> list[StreamingDataset | None]:
    """[train, valid, test] Parquet streams of `sources` (engine/data/sources.py, cut by
    --split): each a blend of the sources by weight, taking its --split share of every
    window's rows (None where a split is asked for no samples or its share of every window
    rounds to no rows)."""
    blend, split, split_weights = sources.train, sources.split, sources.split_weights
    if blend.weights is None and len(blend.prefixes) > 1:
        raise ConfigError(
            f"--data-path {' '.join(sources.given)}: Parquet sources blend by weight only "
            "(their sizes in samples are known only once tokenized); give weight/source pairs"
        )
    kept = [
        (w, s, n)
        for w, s, n in zip(blend.weights or [1.0], blend.prefixes, blend.names, strict=False)
        if w > 0
    ]
    weights, paths = normalize_weights([w for w, _, _ in kept]), [s for _, s, _ in kept]
    names = [n for _, _, n in kept]
    shards = [tuple(open_shards(path, text_column)) for path in paths]
    identity = build_tokenizer(tokenizer).identity()
    result: list[StreamingDataset | None] = []
    for k in range(len(SPLIT_NAMES)):
        if num_samples[k] <= 0 or split_weights[k] == 0:
            result.append(None)
            continue
        plans = [
            StreamPlan(s, identity, text_column, shuffle_buffer, seq_length, seed, split_weights, k)
            for s in shards
        ]
        rows = [plan.has_rows() for plan in plans]
        if not any(rows):
            result.append(None)
            continue
        if not all(rows):
            raise ConfigError(
                f"--split {split} gives the {SPLIT_NAMES[k]} split no row of any window of "
                f"{paths[rows.index(False)]} (windows of --parquet-shuffle-buffer "
                f"{shuffle_buffer} rows); raise the buffer or that split's share"
            )
        result.append(StreamingDataset(plans, weights, num_samples[k], tokenizer, names))
    return result
