"""The perplexity stage's steps in a curation run, after the deduplication (as CCNet scored
what its deduplication left):

    score (per shard)    each document still kept, its duplicate lines dropped, scored under
                         the reference model -> part-PPPPP/perplexity.npz; and the shard's
                         sample for the cutoffs: per language, the `sample` documents of
                         smallest hash of their global number -> perplexity-sample.npz
    cutoffs (one task)   per language, the percentiles of the corpus-wide sample (the same
                         documents whatever the shards and tasks), or the fixed cutoffs
                         -> work/perplexity.json (null for a language none of whose
                         documents had a finite score)

The final step buckets each document by its language's cutoffs.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import xxhash

from engine.curation.atomic import save_json, save_npz
from engine.curation.dedup.layout import Part, shard_name
from engine.curation.documents import read_parquet_rows
from engine.curation.models.perplexity import cutoffs_of, scorer_for

CUTOFFS_FILE = "perplexity.json"
REFERENCE_FILE = "reference-model.json"  # the model folder (and iteration) every task loads


def language_of(row: dict) -> str:
    """The language the cutoffs are computed within ("all" when none is known)."""
    language = row.get("language")
    return language if isinstance(language, str) and language else "all"


def sample_path(work: str, k: int) -> str:
    return os.path.join(work, shard_name(k), "perplexity-sample.npz")


def score_shard(work: str, parts: list[Part], k: int, params, by_lines: bool, key: str) -> None:
    from engine.curation.shard_steps import kept_texts

    with open(os.path.join(work, REFERENCE_FILE)) as f:
        reference = json.load(f)
    scorer = scorer_for(params, reference)
    sample_keys, sample_scores, sample_languages = [], [], []
    for part in (p for p in parts if p.shard == k):
        survivors = read_parquet_rows(os.path.join(part.folder, "survivors.parquet"))[0]
        with np.load(os.path.join(part.folder, "decisions.npz")) as f:
            codes, drop = f["code"], f["drop"]
        texts = kept_texts(survivors, key, drop, by_lines)
        scores = np.full(len(survivors), np.nan)
        alive = np.flatnonzero(codes == 0)
        languages = np.array([language_of(row) for row in survivors], str)
        for i in alive:
            language = languages[i] if languages[i] != "all" else params.default_language
            scores[i] = scorer.score(texts[i], str(language))
        path = os.path.join(part.folder, "perplexity.npz")
        save_npz(path, perplexity=scores, language=languages)
        numbers = alive + part.first_document
        sample_keys.append(np.array([xxhash.xxh64_intdigest(int(n).to_bytes(8, "little"))
                                     for n in numbers], np.uint64))  # fmt: skip
        sample_scores.append(scores[alive])
        sample_languages.append(languages[alive])
    keys = np.concatenate(sample_keys or [np.empty(0, np.uint64)])
    scores = np.concatenate(sample_scores or [np.empty(0)])
    languages = np.concatenate(sample_languages or [np.empty(0, str)])
    chosen = _smallest_per_language(keys, languages, params.sample)
    path = sample_path(work, k)
    save_npz(path, key=keys[chosen], perplexity=scores[chosen], language=languages[chosen])


def _smallest_per_language(keys: np.ndarray, languages: np.ndarray, size: int) -> np.ndarray:
    """Indices of the `size` smallest keys of each language."""
    chosen = []
    for language in np.unique(languages):
        mine = np.flatnonzero(languages == language)
        chosen.append(mine[np.argsort(keys[mine], kind="stable")[:size]])
    return np.sort(np.concatenate(chosen)) if chosen else np.empty(0, np.int64)


def cutoffs_task(work: str, shards: int, params) -> None:
    keys, scores, languages = [], [], []
    for k in range(shards):
        with np.load(sample_path(work, k)) as f:
            keys.append(f["key"])
            scores.append(f["perplexity"])
            languages.append(f["language"])
    keys = np.concatenate(keys or [np.empty(0, np.uint64)])
    scores = np.concatenate(scores or [np.empty(0)])
    languages = np.concatenate(languages or [np.empty(0, str)])
    chosen = _smallest_per_language(keys, languages, params.sample)
    cutoffs = {}
    for language in sorted(set(languages[chosen].tolist())):
        mine = chosen[languages[chosen] == language]
        pair = cutoffs_of(scores[mine], params)
        cutoffs[language] = [x if math.isfinite(x) else None for x in pair]
    save_json(os.path.join(work, CUTOFFS_FILE), cutoffs)


def load_cutoffs(work: str) -> dict[str, tuple[float, float]]:
    with open(os.path.join(work, CUTOFFS_FILE)) as f:
        saved = json.load(f)
    return {k: tuple(math.inf if x is None else x for x in pair) for k, pair in saved.items()}
