"""A split of preprocessed (.bin/.idx or mock) data as a training split (engine/data/split.py):
a blended dataset read in micro-batches by a resumable sampler, whose position is the count
of samples consumed."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from engine.data.loader import WithDomains, build_data_iterator
from engine.data.mix.blended import BlendedDataset


class IndexedBatches:
    """A data loader's micro-batches; the consumed count is its whole position."""

    def __init__(self, batches: Iterator[dict[str, torch.Tensor]]):
        self.batches = batches

    def __iter__(self) -> IndexedBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return next(self.batches)

    def state_dict(self) -> None:
        return None


class IndexedSplit:
    """A BlendedDataset (one dataset or several) as a training split; with several, each
    sample says which it comes from, for the per-dataset losses."""

    def __init__(self, dataset: BlendedDataset):
        self.dataset = dataset
        self.names = tuple(dataset.names)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.dataset[i]

    def iterator(
        self,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        num_workers: int = 0,
        position: dict | None = None,
        pin_memory: bool = False,
    ) -> IndexedBatches:
        dataset = WithDomains(self.dataset) if len(self.names) > 1 else self.dataset
        return IndexedBatches(
            build_data_iterator(
                dataset,
                consumed_samples,
                micro_batch_size,
                dp_rank,
                dp_size,
                num_workers,
                pin_memory,
            )
        )

    def check_position(self, consumed_samples: int, position: dict | None) -> None:
        return None  # any count within the split is a position

    def restart_point(self, consumed_samples: int) -> int:
        return consumed_samples

    def consumed_per_dataset(self, consumed_samples: int) -> Sequence[int]:
        return self.dataset.consumed_per_dataset(consumed_samples).tolist()
