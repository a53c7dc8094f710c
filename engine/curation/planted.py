"""A corpus with planted near-duplicates of known similarity, to measure deduplication.

Each family is an original document of random words and copies of it with words replaced at
random positions, as many as bring the copy's word-shingle Jaccard similarity to the original
near a target. The true similarity of every copy is computed from the shingle sets, and a
copy is a true duplicate when it is at least the threshold: the ground truth does not depend
on how close the edits came to their target.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.curation.minhash import normalise


@dataclass(frozen=True)
class PlantedCorpus:
    texts: list[str]
    family: np.ndarray  # the original each document copies (itself for an original)
    similarity: np.ndarray  # true Jaccard similarity to that original (1 for an original)

    def true_duplicates(self, threshold: float) -> np.ndarray:
        """Documents a deduplication at `threshold` must remove (copies at least that similar
        to their original, which comes first)."""
        return (self.family != np.arange(len(self.texts))) & (self.similarity >= threshold)


def shingle_set(text: str, ngram: int) -> set[str]:
    words = normalise(text).split(" ")
    return {" ".join(words[i : i + ngram]) for i in range(max(1, len(words) - ngram + 1))}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def planted_corpus(
    families: int,
    targets: tuple[float, ...],
    words_per_doc: int = 600,
    ngram: int = 5,
    vocabulary: int = 20_000,
    seed: int = 0,
) -> PlantedCorpus:
    """`families` originals, each followed (after all originals) by one copy per target
    similarity; the originals come first, then the copies family by family."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(vocabulary)]
    originals = [list(rng.choice(words, size=words_per_doc)) for _ in range(families)]
    texts, family, similarity = (
        [" ".join(o) for o in originals],
        list(range(families)),
        [1.0] * families,
    )
    for f, original in enumerate(originals):
        base = shingle_set(texts[f], ngram)
        shingles = len(base)
        for target in targets:
            # each replaced word (apart from the others) changes `ngram` shingles:
            # J = (S - c) / (S + c) with c = ngram * k changed
            k = max(1, round(shingles * (1 - target) / (1 + target) / ngram))
            copy = list(original)
            for position in rng.choice(words_per_doc, size=min(k, words_per_doc), replace=False):
                copy[position] = words[rng.integers(vocabulary)]
            text = " ".join(copy)
            texts.append(text)
            family.append(f)
            similarity.append(jaccard(base, shingle_set(text, ngram)))
    return PlantedCorpus(texts, np.array(family), np.array(similarity))
