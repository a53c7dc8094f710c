"""Documents that share an n-gram (13 words by default, as GPT-3's filtering) with evaluation
data are removed, so that benchmark scores are not inflated by training on the test."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import numpy as np
import xxhash

from engine.curation.documents import read_documents
from engine.curation.minhash import normalise
from engine.errors import ConfigError


@dataclass(frozen=True)
class Decontamination:
    files: tuple[str, ...] = ()  # evaluation data: JSONL, Parquet or text files, or globs
    keys: tuple[str, ...] = ("text",)  # the fields of each record that hold evaluation text
    ngram: int = 13

    def __post_init__(self):
        if self.ngram < 1:
            raise ValueError(f"ngram {self.ngram} must be at least 1")


def _grams(text: str, n: int) -> np.ndarray:
    words = normalise(text).split(" ")
    return np.array(
        [xxhash.xxh64_intdigest(" ".join(words[i : i + n])) for i in range(len(words) - n + 1)],
        dtype=np.uint64,
    )


class ContaminationIndex:
    """The n-grams of every evaluation text, sorted (8 bytes each)."""

    def __init__(self, grams: np.ndarray, ngram: int, short: int = 0):
        self.grams, self.ngram, self.short = grams, ngram, short

    @classmethod
    def build(cls, c: Decontamination) -> ContaminationIndex:
        if not c.files:
            raise ConfigError(
                "--config: decontamination has no evaluation `files`; list them or turn it off"
            )
        parts, short = [], 0
        for pattern in c.files:
            paths = sorted(glob.glob(pattern)) if not os.path.exists(pattern) else [pattern]
            if not paths:
                raise ConfigError(
                    f"--config: decontamination file {pattern}: no such file; fix `files`"
                )
            for path in paths:
                for key in c.keys:
                    fix = "fix `keys` of decontamination in --config"
                    for row in read_documents(path, key, fix)[0]:
                        grams = _grams(row[key], c.ngram)
                        short += len(grams) == 0  # shorter than n words: cannot be matched
                        parts.append(grams)
        grams = np.unique(np.concatenate(parts)) if parts else np.empty(0, np.uint64)
        return cls(grams, c.ngram, short)

    def save(self, path: str) -> None:
        np.save(path, self.grams)

    @classmethod
    def load(cls, path: str, ngram: int) -> ContaminationIndex:
        return cls(np.load(path), ngram)

    def contaminated(self, text: str) -> bool:
        grams = _grams(text, self.ngram)
        if len(grams) == 0 or len(self.grams) == 0:
            return False
        at = np.searchsorted(self.grams, grams)
        at[at == len(self.grams)] = 0
        return bool(np.any(self.grams[at] == grams))
