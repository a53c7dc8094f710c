"""What a run reads, parsed once from the data flags (`DataSources`): the format, and for each
split (train, valid, test) the blend of datasets it draws from and its share of every one.

--data-path is one blend cut by --split into the three splits (each takes a range of every
dataset's documents); --train/valid/test-data-path give each split its own blend, taken whole.
Parquet files and folders stream and are tokenized on the fly; anything else is the prefix of
a preprocessed .bin/.idx dataset; --mock-data generates its documents. The preflight checks,
the mix schedule, the dataset builders and the mix report all receive this one value.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.data import DataConfig
from engine.data.indexed.gpt_dataset import SPLIT_NAMES, parse_split, split_bookends
from engine.data.mix.blended import Blend, parse_blend
from engine.data.streaming.shards import is_parquet_path
from engine.errors import ConfigError

Share = tuple[float, float]  # a split's [start, end) of every dataset, as shares of it


@dataclass(frozen=True)
class DataSources:
    """Each split's blend and share, and the format of the data."""

    format: str  # "indexed", "parquet" or "mock"
    blends: tuple[Blend | None, Blend | None, Blend | None]  # None: no paths for the split
    shares: tuple[Share | None, Share | None, Share | None]  # None: the split gets no share
    split_weights: tuple[float, ...]  # --split's proportions (Parquet cuts each window by them)
    split: str  # --split as given (for messages)
    per_split: bool  # given split by split (--train/valid/test-data-path)
    given: tuple[str, ...] = ()  # the train split's paths as given (for messages)

    @property
    def train(self) -> Blend | None:
        return self.blends[0]

    @property
    def cut_by(self) -> str:
        """What gives each split its share, for messages."""
        return "the per-split paths" if self.per_split else f"--split {self.split}"

    def prefixes(self) -> list[str]:
        """Every dataset of every split, each once, in order."""
        return list(dict.fromkeys(p for b in self.blends if b for p in b.prefixes))


def data_sources(
    data_path: list[str] | None,
    split: str = "969,30,1",
    per_split_paths: tuple[list[str], ...] | None = None,
    data_format: str | None = None,
) -> DataSources:
    """The sources of `data_path` cut by `split`, or of each split's own paths; ConfigError
    (one line) for paths that cannot be read as a blend or that mix formats."""
    if per_split_paths is not None:  # --split is not read
        blends = tuple(
            parse_blend(p, f"--{n}-data-path") if p else None
            for p, n in zip(per_split_paths, SPLIT_NAMES, strict=False)
        )
        shares = tuple((0.0, 1.0) if blend else None for blend in blends)
        kind = _format_of(blends[0].prefixes if blends[0] else (), data_format)
        given = tuple(per_split_paths[0])
        return DataSources(kind, blends, shares, (), split, True, given)
    blend = parse_blend(data_path)
    weights = tuple(parse_split(split))
    shares = tuple(split_bookends(list(weights)))
    kind = _format_of(blend.prefixes, data_format)
    blends = (blend,) * len(SPLIT_NAMES)
    return DataSources(kind, blends, shares, weights, split, False, tuple(data_path))


def sources_of(data: DataConfig) -> DataSources:
    """The sources a run's data config names (resolved: its path files read)."""
    if data.mock_data:
        return DataSources("mock", (None, None, None), (None, None, None), (), data.split, False)
    if not data.data_path and not data.per_split_paths:
        raise ConfigError(
            "--data-path is required (a dataset prefix or weight/prefix pairs), or --mock-data "
            "to try the run on generated documents"
        )
    return data_sources(data.data_path, data.split, data.per_split_paths, data.data_format)


def detect_format(data_path: list[str], given: str | None) -> str:
    """--data-format, or detected from --data-path (see _format_of)."""
    if given is not None:
        return given
    return _format_of(parse_blend(data_path).prefixes, given)


def _format_of(paths, given: str | None) -> str:
    """--data-format, or detected: Parquet files and folders stream, anything else is a prefix
    of a preprocessed dataset."""
    if given is not None:
        return given
    parquet = [p for p in paths if is_parquet_path(p)]
    if parquet and len(parquet) < len(paths):
        other = next(p for p in paths if not is_parquet_path(p))
        raise ConfigError(
            f"--data-path mixes Parquet ({parquet[0]}) and a preprocessed dataset prefix "
            f"({other}); blend one kind at a time, or preprocess the Parquet data"
        )
    return "parquet" if parquet else "indexed"
