"""An indexed dataset of uniformly random tokens: data that conflicts with any real text, for
trying gradient interference (--log-gradient-cosine-interval, --pcgrad) and spike recovery on
a blend (tools/make_random_tokens.py)."""

from __future__ import annotations

import numpy as np

from engine.data.indexed.dataset import IndexedDatasetBuilder, optimal_dtype


def write_random_tokens(
    prefix: str, vocab_size: int, eod: int, documents: int, seed: int = 0, first_id: int = 3
) -> int:
    """`documents` documents of 20 to 199 tokens drawn uniformly from [first_id, vocab_size),
    each ended by `eod`, at `prefix`.bin/.idx. Returns the tokens written."""
    rng = np.random.default_rng(seed)
    written = 0
    with IndexedDatasetBuilder(prefix, optimal_dtype(vocab_size)) as builder:
        for _ in range(documents):
            tokens = rng.integers(first_id, vocab_size, int(rng.integers(20, 200)))
            builder.add_document(np.append(tokens, eod))
            written += tokens.size + 1
        builder.finalize()
    return written
