"""Counts of one shard of a curation run, summed into the report: documents removed per rule,
PII replaced, and the length histograms (characters, words) before and after."""

from __future__ import annotations

from collections import Counter

import numpy as np

from engine.curation.atomic import save_json

# log-spaced bins shared by every shard, so that their histograms add up
CHAR_BINS = np.concatenate([[0], np.logspace(0, 7, 57)])
WORD_BINS = np.concatenate([[0], np.logspace(0, 6, 49)])


def histogram(values: list[int], bins: np.ndarray) -> list[int]:
    return np.histogram(np.clip(values, 0, bins[-1] - 1), bins=bins)[0].astype(int).tolist()


class ShardStats:
    def __init__(self):
        self.reasons: dict[str, int] = {}
        self.lengths = {"before": ([], []), "after": ([], [])}  # (characters, words)
        self.pii_replaced = 0
        self.skipped: Counter = Counter()  # input records left out (WARC), by reason

    def before(self, text: str) -> None:
        self._length("before", text)

    def after(self, text: str) -> None:
        self._length("after", text)

    def _length(self, when: str, text: str) -> None:
        chars, words = self.lengths[when]
        chars.append(len(text))
        words.append(len(text.split()))

    def removed(self, reason: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def pii(self, count: int) -> None:
        self.pii_replaced += count

    def save(self, path: str) -> None:
        out = {"removed": self.reasons, "pii_replaced": self.pii_replaced}
        out["skipped"] = dict(self.skipped)
        for when, (chars, words) in self.lengths.items():
            out[when] = {
                "documents": len(chars),
                "characters": int(sum(chars)),
                "words": int(sum(words)),
                "char_histogram": histogram(chars, CHAR_BINS),
                "word_histogram": histogram(words, WORD_BINS),
            }
        save_json(path, out)  # whole or absent: its presence says the step is done
