"""Perplexity of a model on a preprocessed dataset (.bin/.idx): the mean negative
log-likelihood of every token of consecutive, non-overlapping windows of the dataset's token
stream (documents joined as stored, the first token of each window only conditioned on).
With the training run's document flags (`packing`) the windows are read as it read its
samples: within documents, positions restarting, and with --eod-mask-loss no score for the
predictions made at EOD tokens."""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.data.indexed.dataset import IndexedDataset
from engine.errors import InputError


def windows(prefix: str, length: int, count: int) -> list[list[int]]:
    """The first `count` windows of `length` + 1 tokens of the dataset's token stream."""
    dataset = IndexedDataset(prefix)
    needed, parts, have = count * (length + 1), [], 0
    for i in range(len(dataset.sequence_lengths)):
        if have >= needed:
            break
        part = np.asarray(dataset.get(i), dtype=np.int64)
        parts.append(part)
        have += len(part)
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if len(stream) < length + 1:
        raise InputError(
            f"{prefix}: holds {len(stream)} tokens, fewer than one window of {length + 1}; "
            "lower --seq-length"
        )
    full = min(count, len(stream) // (length + 1))
    return [stream[k * (length + 1) : (k + 1) * (length + 1)].tolist() for k in range(full)]


def perplexity(token_logprobs, model, prefix: str, length: int, count: int, packing=None) -> dict:
    """{"nll": mean negative log-likelihood per token, "ppl": exp of it, "tokens": scored}."""
    total, tokens = 0.0, 0
    for window in windows(prefix, length, count):
        logprobs = token_logprobs(model, window, packing)
        if packing is not None and packing.eod_mask_loss:
            scored = torch.tensor(window[:-1], device=logprobs.device) != packing.eod
            logprobs = logprobs[scored]
        total -= float(logprobs.sum())
        tokens += len(logprobs)
    nll = total / tokens
    return {"nll": nll, "ppl": math.exp(min(nll, 50.0)), "tokens": tokens}
