"""Documents that share an n-gram (13 words by default, as GPT-3's filtering) with evaluation
data are removed, so that benchmark scores are not inflated by training on the test."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from engine.curation.minhash import normalise
from engine.data.readers import decode_record, expand_inputs, iter_records
from engine.errors import ConfigError


@dataclass(frozen=True)
class Decontamination:
    files: tuple[str, ...] = ()  # evaluation data: JSONL, Parquet or text, as --input reads
    keys: tuple[str, ...] = ("text",)  # the fields of each record that hold evaluation text
    ngram: int = 13


def _grams(text: str, n: int) -> np.ndarray:
    words = normalise(text).split(" ")
    return np.array(
        [xxhash.xxh64_intdigest(" ".join(words[i : i + n])) for i in range(len(words) - n + 1)],
        dtype=np.uint64,
    )


class ContaminationIndex:
    """The n-grams of every evaluation text, sorted (8 bytes each)."""

    def __init__(self, c: Decontamination):
        if not c.files:
            raise ConfigError(
                "decontamination: no evaluation `files` given; list them or turn it off"
            )
        parts, self.short = [], 0
        for path in expand_inputs(list(c.files)):
            for record in iter_records([path], list(c.keys)):
                for text in decode_record(record, list(c.keys)).values():
                    grams = _grams(text, c.ngram)
                    self.short += len(grams) == 0  # shorter than n words: cannot be matched
                    parts.append(grams)
        self.grams = np.unique(np.concatenate(parts)) if parts else np.empty(0, np.uint64)
        self.ngram = c.ngram

    def contaminated(self, text: str) -> bool:
        grams = _grams(text, self.ngram)
        if len(grams) == 0 or len(self.grams) == 0:
            return False
        at = np.searchsorted(self.grams, grams)
        at[at == len(self.grams)] = 0
        return bool(np.any(self.grams[at] == grams))
