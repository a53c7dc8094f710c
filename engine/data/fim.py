"""Fill-in-the-middle (FIM) samples for code data: Megatron-LM's GPTFIMDataset transformation
(--fim-data and the --fim-* flags, megatron/training/datasets/fim_dataset.py), drawn per sample
index.

A sample of `seq_length + 1` tokens is cut at its EOD tokens (--fim-eod-token) into
documents. Each non-empty document, and whatever follows the last EOD (even nothing), is with
probability --fim-rate rearranged: its text (decoded) is cut at two uniformly drawn character
positions into prefix, middle and suffix, each re-encoded, and written as
`<fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle` (PSM) or, with probability
--fim-spm-rate, `<fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle` (SPM); a
document whose text starts with --fim-no-prefix stays as it is. With --fim-split-sample a
document holding that token is instead rearranged fragment by fragment (each at
--fim-fragment-rate) when a draw at --fim-rate says so. The pieces are joined with one EOD
after each non-empty document (an empty one between two EODs vanishes, as there), and the
result is cut or padded with --fim-pad-token back to the sample's length.

Megatron-LM draws from one generator per dataset in the order samples are read, so which
sample is rearranged depends on the reading order (workers, data-parallel size, resumption).
Here each sample's draws come from a generator seeded by (--seed, the sample's index in its
split), in the same sequence as Megatron-LM's: the same sample always, whatever reads it
(tools/megatron_fim_check.py compares the two given the same generator).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config.fim import FimConfig
from engine.data.tokenizers.base import Tokenizer, plain
from engine.errors import ConfigError


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split: int | None  # --fim-split-sample's token


def fim_tokens(cfg: FimConfig, tokenizer: Tokenizer) -> FimTokens:
    """The ids of the FIM tokens; ConfigError (one line) for one the tokenizer lacks."""
    ids = {}
    for flag, text in cfg.token_flags.items():
        found = tokenizer.token_id(text)
        if found is None:
            raise ConfigError(
                f"{flag} {text!r} is not a token of {tokenizer.source}; give one of its tokens "
                "or a tokenizer that has the fill-in-the-middle tokens"
            )
        ids[flag] = found
    return FimTokens(
        ids["--fim-prefix-token"],
        ids["--fim-middle-token"],
        ids["--fim-suffix-token"],
        ids["--fim-pad-token"],
        ids["--fim-eod-token"],
        ids.get("--fim-split-sample"),
    )


class FimTransform:
    """sample (np.ndarray of ids), its index -> the sample in FIM form (the same length)."""

    def __init__(self, cfg: FimConfig, tokenizer: Tokenizer, seed: int):
        self.cfg, self.seed = cfg, seed
        self.tokens = fim_tokens(cfg, tokenizer)
        self.tokenizer = plain(tokenizer)

    def __call__(self, sample: np.ndarray, index: int) -> np.ndarray:
        rng = np.random.RandomState([self.seed, index])
        return self.transform(sample, rng)

    def transform(self, sample: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        eod = self.tokens.eod
        breaks = np.flatnonzero(sample == eod)
        if len(breaks):
            pieces, start = [], 0
            for at in breaks:
                if at > start:  # an empty document between two EODs is dropped with its EOD
                    pieces += [self._document(sample[start:at], rng), np.array([eod])]
                start = at + 1
            pieces.append(self._document(sample[start:], rng))
            out = np.concatenate(pieces)
        else:
            out = self._document(sample, rng)
        if len(out) >= len(sample):
            return np.asarray(out[: len(sample)], dtype=np.int64)
        padding = np.full(len(sample) - len(out), self.tokens.pad, dtype=np.int64)
        return np.concatenate([out, padding]).astype(np.int64)

    def _document(self, document: np.ndarray, rng) -> np.ndarray:
        split, cfg = self.tokens.split, self.cfg
        if split is None:
            return self._rearrange(document, cfg.fim_rate, rng)
        cuts = np.flatnonzero(document == split)
        if not len(cuts):
            return self._rearrange(document, cfg.fim_rate, rng)
        if not rng.binomial(1, cfg.fim_rate):
            return document
        pieces, start = [], 0
        for at in cuts:
            if at > start:
                piece = self._rearrange(document[start:at], cfg.fim_fragment_rate, rng)
                pieces += [piece, np.array([split])]
            start = at + 1
        pieces.append(self._rearrange(document[start:], cfg.fim_fragment_rate, rng))
        return np.concatenate(pieces)

    def _rearrange(self, ids: np.ndarray, rate: float, rng) -> np.ndarray:
        if not rng.binomial(1, rate):
            return ids
        text = self.tokenizer.detokenize(ids)
        no_prefix = self.cfg.fim_no_prefix
        if no_prefix is not None and text.startswith(no_prefix):
            return ids
        low, high = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (
            np.array(self.tokenizer.tokenize(part), dtype=np.int64)
            for part in (text[:low], text[low:high], text[high:])
        )
        t = self.tokens
        if rng.binomial(1, self.cfg.fim_spm_rate):
            return np.concatenate([[t.prefix, t.suffix], suffix, [t.middle], prefix, middle])
        return np.concatenate([[t.prefix], prefix, [t.suffix], suffix, [t.middle], middle])


class FimSamples:
    """A split's dataset with its samples in FIM form (each drawn by its index)."""

    def __init__(self, dataset, transform: FimTransform):
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.transform(np.asarray(self.dataset[i]), i)

    def __getattr__(self, name: str):  # names, domain(i), ... of the dataset underneath
        if name == "dataset":  # not set yet (an instance being copied)
            raise AttributeError(name)
        return getattr(self.dataset, name)
