"""One split of a run's data (train, valid or test) as the loop, evaluation and checkpoints use
it, whatever its format: preprocessed datasets (engine/data/indexed/split.py) and Parquet
streams (engine/data/streaming/dataset.py) both implement `TrainingSplit`, so no caller tests
which one it holds."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch


class SplitIterator(Protocol):
    """A data-parallel rank's micro-batches ({"tokens", "labels"[, "domain"]} tensors)."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]: ...

    def __next__(self) -> dict[str, torch.Tensor]: ...

    def state_dict(self) -> dict | None:
        """Where the split stands, for a checkpoint, beyond the count of samples consumed
        (None: the count says it all)."""
        ...


class TrainingSplit(Protocol):
    """A split of `len()` samples; `names`: its datasets' names, one per dataset it blends."""

    names: tuple[str, ...]

    def __len__(self) -> int: ...

    def iterator(
        self,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        num_workers: int = 0,
        position: dict | None = None,
        pin_memory: bool = False,
    ) -> SplitIterator:
        """This DP rank's micro-batches from `consumed_samples` on (and from the saved
        `position`, where the split keeps one); pinned memory for asynchronous GPU copies."""
        ...

    def check_position(self, consumed_samples: int, position: dict | None) -> None:
        """On a rank that reads no batches: fail (on every rank alike) where `iterator`
        would fail for this count and position."""
        ...

    def restart_point(self, consumed_samples: int) -> int:
        """Where reading goes on, without a saved position, after `consumed_samples`: the
        count itself where the split seeks by count, else its start."""
        ...

    def consumed_per_dataset(self, consumed_samples: int) -> Sequence[int] | None:
        """How many of the first `consumed_samples` samples each dataset gave (None where
        that is known only while reading)."""
        ...
