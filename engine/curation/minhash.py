"""Near-duplicate documents by MinHash and locality-sensitive hashing (LSH).

A document is the set of its shingles: n-grams of words (or of characters) of its normalised
text (lower case, punctuation to spaces, runs of whitespace to one space). Its signature is,
for each of `bands * rows` hash functions h(x) = (a x + b) mod (2^61 - 1), truncated to 32
bits, the minimum over its shingles' 32-bit xxhash values: two signatures agree in one
position with probability equal to the sets' Jaccard similarity. LSH cuts the signature into
`bands` bands of `rows` values; documents equal in any whole band are candidates. The bands,
rows and the verification below are chosen so that a pair at the threshold is found with
probability `recall` (0.98), removing as few pairs 0.1 below it as that allows
(engine/curation/lsh_plan.py).

Bounded memory: signatures go to a file (a numpy memmap, `n_docs x bands * rows` uint32),
and the index is built one band at a time by sorting that band's keys (8 bytes a document),
never a dictionary of every band. Candidates are joined (union-find) after checking that
their signatures agree in at least the plan's `agree` positions; each cluster keeps its first
document.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import xxhash

from engine.curation.lsh_plan import LSHPlan, plan_lsh

MERSENNE = np.uint64((1 << 61) - 1)
MAX_HASH = np.uint64(0xFFFFFFFF)
_PUNCTUATION = re.compile(r"[^\w\s]|_")
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class MinHashConfig:
    threshold: float = 0.8  # Jaccard similarity from which two documents are duplicates
    num_perm: int = 128  # hash functions (bands * rows <= num_perm)
    ngram: int = 5  # shingle length
    unit: str = "word"  # "word" or "char" shingles
    seed: int = 42
    verify: bool = True  # join candidates only when their signatures agree enough
    recall: float = 0.98  # the probability that a pair at the threshold is found

    def __post_init__(self):
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold {self.threshold} is not between 0 and 1")
        if self.num_perm < 2 or self.ngram < 1:
            raise ValueError("num_perm must be at least 2 and ngram at least 1")
        if self.unit not in ("word", "char"):
            raise ValueError(f"unit {self.unit!r} is not 'word' or 'char'")
        if not 0.0 < self.recall < 1.0:
            raise ValueError(f"recall {self.recall} is not between 0 and 1")
        plan = plan_lsh(self.threshold, self.num_perm, self.recall, self.verify)
        object.__setattr__(self, "_plan", plan)  # worked out once (not a field)

    def plan(self) -> LSHPlan:
        """Bands, rows and verification (engine/curation/lsh_plan.py)."""
        return self._plan

    def bands_rows(self) -> tuple[int, int]:
        plan = self.plan()
        return plan.bands, plan.rows


def normalise(text: str) -> str:
    return _SPACES.sub(" ", _PUNCTUATION.sub(" ", text.lower())).strip()


def shingle_hashes(text: str, ngram: int, unit: str = "word") -> np.ndarray:
    """32-bit hashes of the document's distinct shingles (a short text is one shingle)."""
    text = normalise(text)
    parts = text.split(" ") if unit == "word" else list(text)
    sep = " " if unit == "word" else ""
    count = max(1, len(parts) - ngram + 1)
    shingles = {sep.join(parts[i : i + ngram]) for i in range(count)}
    return np.fromiter(
        (xxhash.xxh32_intdigest(s.encode("utf-8")) for s in shingles),
        dtype=np.uint64,
        count=len(shingles),
    )


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    a = rng.randint(1, 1 << 32, size=num_perm, dtype=np.uint64)
    b = rng.randint(0, 1 << 32, size=num_perm, dtype=np.uint64)
    return a, b


def signature(hashes: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The MinHash signature (uint32, one value per hash function) of a set of hashes."""
    # a, x < 2^32: a * x + b stays below 2^64; shingles in blocks to bound the memory
    lowest = np.full(len(a), MAX_HASH, dtype=np.uint64)
    for start in range(0, len(hashes), 4096):
        block = hashes[start : start + 4096, None]
        values = (block * a[None, :] + b[None, :]) % MERSENNE & MAX_HASH
        np.minimum(lowest, values.min(axis=0), out=lowest)
    return lowest.astype(np.uint32)


def signatures(texts, config: MinHashConfig, path: str | None = None) -> np.ndarray:
    """[n_docs, bands * rows] signatures, in a memmap at `path` when given."""
    bands, rows = config.bands_rows()
    a, b = permutations(bands * rows, config.seed)
    texts = list(texts)
    shape = (len(texts), bands * rows)
    out = (
        np.lib.format.open_memmap(path, mode="w+", dtype=np.uint32, shape=shape)
        if path is not None
        else np.empty(shape, dtype=np.uint32)
    )
    for i, text in enumerate(texts):
        out[i] = signature(shingle_hashes(text, config.ngram, config.unit), a, b)
    return out


def band_keys(sigs: np.ndarray, config: MinHashConfig) -> np.ndarray:
    """[n_docs, bands] keys: a 64-bit hash of each band's values (equal bands, equal keys)."""
    bands, rows = config.bands_rows()
    keys = np.empty((len(sigs), bands), np.uint64)
    for band in range(bands):
        block = np.ascontiguousarray(sigs[:, band * rows : (band + 1) * rows])
        keys[:, band] = [xxhash.xxh64_intdigest(row.tobytes()) for row in block]
    return keys


def duplicate_of(sigs: np.ndarray, config: MinHashConfig) -> np.ndarray:
    """For each document, the first document of its cluster (itself when it is kept)."""
    plan = config.plan()
    bands = plan.bands
    n = len(sigs)
    parent = np.arange(n)

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    all_keys = band_keys(sigs, config)
    for band in range(bands):
        keys = all_keys[:, band]
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        same = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])
        for k in same:  # neighbours in the sorted band: a chain joins the whole bucket
            i, j = int(order[k]), int(order[k + 1])
            if plan.agree and np.count_nonzero(sigs[i] == sigs[j]) < plan.agree:
                continue
            ri, rj = root(i), root(j)
            if ri != rj:
                parent[max(ri, rj)] = min(ri, rj)
    return np.array([root(i) for i in range(n)])
