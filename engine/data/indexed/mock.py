"""--mock-data: synthetic documents, so that a launch can be tried with no data at all.

The documents are Megatron-LM's mock documents: 100,000 of them, whose lengths are drawn once
from numpy's default_rng(0) between 1 and 4095; document i of length L holds the ids
1, 2, ..., L - 1 (modulo the vocabulary) and then the end-of-document id. They are split
1:1:1 into train, valid and test and packed and shuffled like any indexed dataset.
"""

from __future__ import annotations

import numpy as np

MOCK_DOCUMENTS = 100_000
MOCK_MAX_LENGTH = 4096
MOCK_SPLIT = "1,1,1"


class MockIndexedDataset:
    """The part of IndexedDataset's interface GPTDataset reads, for generated documents."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size, self.eod = vocab_size, eod
        rng = np.random.default_rng(seed=0)
        self.sequence_lengths = rng.integers(
            low=1, high=MOCK_MAX_LENGTH, size=MOCK_DOCUMENTS, dtype=np.int32
        )
        self.document_indices = np.arange(MOCK_DOCUMENTS + 1, dtype=np.int64)
        self.prefix = f"mock-vocab{vocab_size}-eod{eod}"

    @property
    def num_documents(self) -> int:
        return MOCK_DOCUMENTS

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside mock document {i}")
        document = np.empty(size, dtype=np.int64)
        document[:-1] = np.arange(1, size) % self.vocab_size
        document[-1] = self.eod
        return document[offset : offset + length]

    def close(self) -> None:
        pass
