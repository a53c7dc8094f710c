"""Tokens and epochs per dataset of a planned run's blend (tools/mix_report.py).

For each dataset of the train split's blend: the tokens its share of the split holds, the
samples the run will take from it (the same order training builds: megatron-core's blending
rule, or --data-mix-schedule's phases), and so how many times it is seen. Prefixes given
alone (no weights) blend one epoch of each, as Megatron-LM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.data.indexed.dataset import IndexedDataset
from engine.data.indexed.gpt_dataset import sequence_range
from engine.data.mix.schedule import plain_schedule, train_mix
from engine.data.sources import data_sources
from engine.errors import ConfigError


@dataclass(frozen=True)
class DatasetPlan:
    name: str
    prefix: str
    weights: tuple[float, ...]  # its weight in each phase of the mix
    tokens_available: int  # in its share of the train split
    samples_planned: int
    seq_length: int

    @property
    def tokens_planned(self) -> int:
        return self.samples_planned * self.seq_length

    @property
    def epochs(self) -> float:
        return self.tokens_planned / self.tokens_available if self.tokens_available else 0.0


def plan_mix(data, train, seq_length: int, batches) -> tuple[list[DatasetPlan], list[int]]:
    """(one plan per dataset of the train blend, the first iteration of each phase) for a run
    of `train` (TrainingConfig, its length resolved) over `data` (DataConfig)."""
    paths = data.train_data_path or data.data_path
    if data.mock_data or not paths:
        raise ConfigError("--data-path: give the blend to report on (weight name:PREFIX ...)")
    sources = data_sources(data.data_path, data.split, data.per_split_paths)
    if sources.format == "parquet":
        raise ConfigError(
            "--data-path: Parquet sources are reported once tokenized; preprocess them "
            "(tools/preprocess_data.py) or give their .bin/.idx prefixes"
        )
    blend, share = sources.train, sources.shares[0]
    if blend is None or share is None:
        raise ConfigError(f"--split {data.split} gives the train split no documents")
    available = []
    for prefix in blend.prefixes:
        lengths = IndexedDataset(prefix).sequence_lengths
        start, end = sequence_range(len(lengths), share)
        available.append(int(np.sum(lengths[start:end], dtype=np.int64)))
    _, total = batches.sizes(train.train_iters)
    mix = train_mix(blend, data.data_mix_schedule, train.train_iters, batches)
    if mix is None:  # one dataset
        mix = plain_schedule(blend.names, [1.0])
    if blend.weights is None and len(blend.prefixes) > 1:  # one epoch of each, by size
        samples = [max(0, (t - 1) // seq_length) for t in available]
        mix = plain_schedule(blend.names, samples)
        total = min(total, sum(samples))
    counts = np.bincount(mix.blending_indices(total)[0], minlength=len(blend.names))
    plans = [
        DatasetPlan(
            name,
            prefix,
            tuple(p.weights[d] for p in mix.phases),
            available[d],
            int(counts[d]),
            seq_length,
        )
        for d, (name, prefix) in enumerate(zip(blend.names, blend.prefixes, strict=False))
    ]
    return plans, [p.iteration for p in mix.phases]
