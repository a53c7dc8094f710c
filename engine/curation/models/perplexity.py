"""Scoring documents by their perplexity under a reference language model, as CCNet did, to
keep a band of them: CCNet's head (the most fluent), middle and tail buckets.

The reference model is a model trained by tripod on trusted text (its checkpoint folder) or
any Hugging Face causal LM folder (config.json + safetensors, imported as
tools/convert_checkpoint.py --from-hf imports it: loading runs no code). A document's
perplexity is exp of the mean negative log-likelihood of its first `max_tokens` tokens, each
predicted from those before it (the first from the tokenizer's BOS, else its end-of-document
token), written to the document as the field `perplexity`.

Buckets, as CCNet: `head` below the cutoff at the 30th percentile, `middle` below the 60th,
`tail` the rest; the cutoffs are given (`cutoffs: [head's upper, middle's upper]`) or computed
over the run's documents that survive deduplication, per language when the language stage is
on (CCNet computed them per language over a sample). Documents in a bucket not in `keep` are
removed (`perplexity:<bucket>`); the kept ones get the field `perplexity_bucket`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from engine.errors import ConfigError

BUCKETS = ("head", "middle", "tail")


@dataclass(frozen=True)
class Perplexity:
    model: str = ""  # a tripod checkpoint folder or a Hugging Face causal LM folder
    keep: tuple = ("head", "middle")  # CCNet's buckets kept
    percentiles: tuple = (30.0, 60.0)  # CCNet's head and middle upper percentiles
    cutoffs: tuple = ()  # fixed (head's upper, middle's upper) perplexities; (): computed
    max_tokens: int = 1024  # tokens of a document scored (its start)
    threads: int = 1  # torch threads per worker

    def __post_init__(self):
        unknown = [b for b in self.keep if b not in BUCKETS]
        if unknown or not self.keep:
            raise ValueError(f"keep {list(self.keep)}: give some of {', '.join(BUCKETS)}")
        for name, pair in (("percentiles", self.percentiles), ("cutoffs", self.cutoffs)):
            if name == "cutoffs" and not pair:
                continue
            if len(pair) != 2 or not all(isinstance(x, int | float) for x in pair):
                raise ValueError(f"{name} {list(pair)}: give two numbers, the lower first")
            if not pair[0] <= pair[1]:
                raise ValueError(f"{name} {list(pair)}: give the lower first")
        if not (self.percentiles[0] >= 0 and self.percentiles[1] <= 100):
            raise ValueError(f"percentiles {list(self.percentiles)}: give them within 0..100")
        if self.max_tokens < 1 or self.threads < 1:
            raise ValueError("max_tokens and threads: give at least 1")

    def check(self, where: str) -> None:
        if not self.model:
            raise ConfigError(
                f"{where}: on without a model; give model: a tripod checkpoint folder or a "
                "Hugging Face causal LM folder"
            )
        if not os.path.isdir(self.model):
            raise ConfigError(f"{where}: model {self.model} is not a folder; give a checkpoint")


class PerplexityScorer:
    """`score(text)` -> the document's perplexity under the reference model (loaded once per
    shard, on the CPU)."""

    def __init__(self, params: Perplexity):
        import torch

        from engine.eval.loading import load_model, plain_tokenizer

        torch.set_num_threads(params.threads)
        self.model, tokenizer, _ = load_model(params.model)
        self.tokenizer = plain_tokenizer(tokenizer)
        self.prefix = tokenizer.bos if tokenizer.bos is not None else tokenizer.eod
        # the prefix takes one position
        self.length = min(params.max_tokens, self.model.config.max_positions - 1)

    def score(self, text: str) -> float:
        from engine.eval.loading import token_logprobs

        ids = self.tokenizer.tokenize(text)[: self.length]
        if not ids:
            return math.inf
        logprobs = token_logprobs(self.model, [self.prefix, *ids])
        return math.exp(min(-float(logprobs.mean()), 700.0))


def cutoffs_of(scores: np.ndarray, params: Perplexity) -> tuple[float, float]:
    """The (head, middle) upper perplexities: given, or the percentiles of `scores`."""
    if params.cutoffs:
        return float(params.cutoffs[0]), float(params.cutoffs[1])
    finite = scores[np.isfinite(scores)]
    if not len(finite):
        return math.inf, math.inf
    low, high = np.percentile(finite, params.percentiles)
    return float(low), float(high)


def buckets_of(scores: np.ndarray, cutoffs: tuple[float, float]) -> np.ndarray:
    """Each score's bucket: 0 head (below the first cutoff), 1 middle, 2 tail."""
    return np.where(scores < cutoffs[0], 0, np.where(scores < cutoffs[1], 1, 2)).astype(np.int8)
