"""Repeated word n-grams of a document, for Gopher's repetition rules, with numpy.

Words become integer ids and each n-gram a 64-bit polynomial hash of its ids (wrapping
arithmetic), so that finding repeats is sorting, not building millions of tuples. Only the
left-to-right scan of `duplicate_chars`, whose skips depend on what it met, stays a loop, and
it starts at the first repeat: before it every n-gram is new.
"""

from __future__ import annotations

import numpy as np

_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplication by it is a bijection mod 2^64


class DocumentNgrams:
    """The words of one document, ready for n-gram questions."""

    def __init__(self, words: list[str]):
        ids: dict[str, int] = {}
        self.ids = np.array([ids.setdefault(w, len(ids) + 1) for w in words], np.uint64)
        self.ends = np.concatenate([[0], np.cumsum([len(w) for w in words])]).astype(np.int64)

    def hashes(self, n: int) -> np.ndarray:
        """One hash per n-gram (position i covers words i .. i + n - 1)."""
        count = len(self.ids) - n + 1
        if count <= 0:
            return np.empty(0, np.uint64)
        out = np.zeros(count, np.uint64)
        with np.errstate(over="ignore"):
            for k in range(n):
                out = out * _BASE + self.ids[k : k + count]
        return out

    def gram_chars(self, i: np.ndarray | int, n: int):
        """Characters of the words of the n-gram(s) at i, without separators."""
        return self.ends[i + n] - self.ends[i]

    def top_chars(self, n: int) -> int:
        """The most frequent n-gram's characters (words joined by spaces) times its count;
        among n-grams as frequent, the one seen first."""
        hashes = self.hashes(n)
        if not len(hashes):
            return 0
        _, first, counts = np.unique(hashes, return_index=True, return_counts=True)
        top = counts.max()
        at = int(first[counts == top].min())
        return int((self.gram_chars(at, n) + n - 1) * top)

    def duplicate_chars(self, n: int) -> int:
        """Characters (without separators) of the n-grams equal to one met before, scanning
        left to right; after a repeat the scan jumps past it, so each word counts once."""
        hashes = self.hashes(n)
        if not len(hashes):
            return 0
        _, inverse, counts = np.unique(hashes, return_inverse=True, return_counts=True)
        if counts.max() == 1:
            return 0
        first_seen = np.full(len(counts), len(hashes))
        np.minimum.at(first_seen, inverse, np.arange(len(hashes)))
        earlier = first_seen[inverse] < np.arange(len(hashes))  # an equal one came before
        start = int(np.argmax(earlier))  # before it, every n-gram is new and is visited
        seen = set(hashes[:start].tolist())
        values = hashes.tolist()
        chars, i = 0, start
        while i < len(values):
            if values[i] in seen:
                chars += int(self.gram_chars(i, n))
                i += n
            else:
                seen.add(values[i])
                i += 1
        return chars
