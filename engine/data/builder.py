"""From --data-path / --split / sample counts to the train, valid and test datasets."""

from __future__ import annotations

from engine.data.blended import BlendedDataset, blend_counts, parse_data_path
from engine.data.gpt_dataset import (
    SPLIT_NAMES,
    GPTDataset,
    GPTDatasetSpec,
    parse_split,
    split_ranges,
)
from engine.data.indexed import IndexedDataset
from engine.data.mock import MOCK_SPLIT, MockIndexedDataset
from engine.data.parquet_shards import is_parquet_path, open_shards
from engine.data.streaming import StreamingDataset, StreamPlan
from engine.data.tokenizers import TokenizerConfig, build_tokenizer
from engine.errors import ConfigError


def build_gpt_datasets(
    data_path: list[str],
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
) -> list[BlendedDataset | None]:
    """[train, valid, test]: each a blend (a single prefix is a blend of one) of exactly
    num_samples[k] samples, or None where a split is asked for no samples or its share of
    the documents rounds to none in every dataset (e.g. a 0.1% test split of a small corpus)."""
    weights, prefixes = parse_data_path(data_path)
    split_weights = parse_split(split)
    indexed = [IndexedDataset(prefix) for prefix in prefixes]
    result: list[BlendedDataset | None] = []
    for k, name in enumerate(SPLIT_NAMES):
        if num_samples[k] <= 0 or split_weights[k] == 0:
            result.append(None)
            continue
        ranges = [split_ranges(d.num_documents, split_weights)[k] for d in indexed]
        if all(end <= start for start, end in ranges):
            result.append(None)
            continue
        which, nth, counts = blend_counts(weights, num_samples[k])
        parts = []
        for prefix, dataset, count, document_range in zip(prefixes, indexed, counts, ranges):
            spec = GPTDatasetSpec(prefix, name, document_range, int(count), seq_length, seed)
            parts.append(GPTDataset(dataset, spec, cache_dir) if count else _Empty())
        result.append(BlendedDataset(parts, weights, num_samples[k], which, nth))
    return result


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
    ranges = split_ranges(mock.num_documents, parse_split(MOCK_SPLIT))
    result: list[BlendedDataset | None] = []
    for k, name in enumerate(SPLIT_NAMES):
        if num_samples[k] <= 0:
            result.append(None)
            continue
        spec = GPTDatasetSpec(mock.prefix, name, ranges[k], num_samples[k], seq_length, seed)
        part = GPTDataset(mock, spec, cache_dir, cache=cache_dir is not None)
        which, nth, _ = blend_counts([1.0], num_samples[k])
        result.append(BlendedDataset([part], [1.0], num_samples[k], which, nth))
    return result


def data_format(data_path: list[str], given: str | None) -> str:
    """--data-format, or detected: Parquet files and folders stream, anything else is a prefix
    of a preprocessed dataset."""
    if given is not None:
        return given
    _, paths = parse_data_path(data_path)
    parquet = [p for p in paths if is_parquet_path(p)]
    if parquet and len(parquet) < len(paths):
        other = next(p for p in paths if not is_parquet_path(p))
        raise ConfigError(
            f"--data-path mixes Parquet ({parquet[0]}) and a preprocessed dataset prefix "
            f"({other}); blend one kind at a time, or preprocess the Parquet data"
        )
    return "parquet" if parquet else "indexed"


def build_streaming_datasets(
    data_path: list[str],
    text_column: str,
    shuffle_buffer: int,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    tokenizer: TokenizerConfig,
) -> list[StreamingDataset | None]:
    """[train, valid, test] Parquet streams: each a blend of the sources by weight, taking its
    --split share of every window's rows (None where a split is asked for no samples or its
    share of every window rounds to no rows)."""
    weights, sources = parse_data_path(data_path)
    split_weights = tuple(parse_split(split))
    shards = [tuple(open_shards(source, text_column)) for source in sources]
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
                f"{sources[rows.index(False)]} (windows of --parquet-shuffle-buffer "
                f"{shuffle_buffer} rows); raise the buffer or that split's share"
            )
        result.append(StreamingDataset(plans, weights, num_samples[k], tokenizer))
    return result


class _Empty:
    """Stands for a dataset whose weight yields no samples in a small blend."""

    def __len__(self) -> int:
        return 0

    def __getitem__(self, i: int):
        raise IndexError(i)
