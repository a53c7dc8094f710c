"""How much attention work packed documents leave, and how context parallelism spreads it.

Attention work is counted in (query, key) pairs computed: causal attention over a sample of s
tokens computes s(s+1)/2 per head, attention within documents (--reset-attention-mask) the sum
of L(L+1)/2 over its documents' lengths L. Under context parallelism a rank's work is that of
its queries (two load-balanced chunks, parallel/context_parallel/chunks.py): each query sees
its own position's worth of keys causally, its position inside its document's within
documents. `mixed_documents` packs a stream of documents of mixed lengths (log-normal, as a web
corpus's) into samples as GPTDataset packs a corpus, for tools/bench_attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.data.documents import document_layout
from parallel.context_parallel.chunks import rank_positions

EOD = 0


def mixed_documents(
    samples: int, seq: int, median: float = 400.0, sigma: float = 1.2, seed: int = 0
) -> torch.Tensor:
    """Input tokens [samples, seq] of a stream of documents with log-normal lengths (median
    `median` tokens), each ended by EOD (token 0; the others 1), cut into consecutive samples."""
    rng = np.random.default_rng(seed)
    total = samples * seq
    stream = np.ones(total, dtype=np.int64)
    at = 0
    while at < total:
        at += max(1, int(rng.lognormal(np.log(median), sigma)))
        if at <= total:
            stream[at - 1] = EOD
    return torch.from_numpy(stream.reshape(samples, seq))


def document_ids(tokens: torch.Tensor) -> torch.Tensor:
    return document_layout(tokens, EOD, reset_attention_mask=True).document_ids


def keys_per_query(tokens: torch.Tensor, documents: bool) -> torch.Tensor:
    """[b, s]: the keys each query attends to, causally (position + 1) or within its document
    (its position in the document + 1)."""
    if not documents:
        return torch.arange(1, tokens.shape[-1] + 1).expand(tokens.shape)
    layout = document_layout(tokens, EOD, reset_position_ids=True)
    return layout.position_ids + 1


@dataclass(frozen=True)
class AttentionWork:
    """(query, key) pairs per head of a batch of samples, causal and within documents, and
    under context parallelism each rank's share of the documents' (max / mean)."""

    causal: int
    documents: int
    documents_per_sample: float
    rank_pairs: tuple[int, ...]  # within documents, each CP rank's queries

    @property
    def kept(self) -> float:
        """The share of the causal work left with documents."""
        return self.documents / self.causal

    @property
    def imbalance(self) -> float:
        """max / mean of the CP ranks' work within documents (1.0: perfectly even)."""
        pairs = self.rank_pairs
        return max(pairs) / (sum(pairs) / len(pairs))


def attention_work(tokens: torch.Tensor, cp_size: int = 1) -> AttentionWork:
    causal = int(keys_per_query(tokens, False).sum())
    within = keys_per_query(tokens, True)
    seq = tokens.shape[-1]
    ranks = tuple(int(within[:, rank_positions(seq, cp_size, r)].sum()) for r in range(cp_size))
    count = float((document_ids(tokens)[:, -1] + 1).float().mean())
    return AttentionWork(causal, int(within.sum()), count, ranks)
