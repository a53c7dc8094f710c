"""Training a fastText document classifier from positive and negative document files, as DCLM
trained its quality filter (positives: reference text; negatives: the crawl to be filtered):
each document one line `__label__<label> <its lines joined by spaces>`, word bigrams, the two
classes balanced by sampling the larger down, a held-out share scored at the end.

Training runs on one thread by default: fastText's result then depends only on the seed.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import numpy as np

from engine.curation.documents import iter_documents
from engine.curation.models.classifier import (
    LABEL_PREFIX,
    classifier_text,
    label_probability,
    load_fasttext,
)
from engine.errors import ConfigError


@dataclass(frozen=True)
class TrainingSettings:
    positive_label: str = "hq"  # DCLM's labels
    negative_label: str = "cc"
    epoch: int = 5
    lr: float = 0.1
    dim: int = 100
    word_ngrams: int = 2  # word bigrams, as DCLM's classifier
    min_count: int = 1
    threads: int = 1
    seed: int = 0
    balance: bool = True  # the larger class sampled down to the smaller's size
    validation: float = 0.1  # share of each class held out and scored
    max_documents: int = 0  # per class, 0: every document


@dataclass(frozen=True)
class Evaluation:
    documents: int
    accuracy: float  # at a threshold of 0.5
    precision: float
    recall: float
    auc: float  # the probability a held-out positive scores above a held-out negative


def read_texts(paths: list[str], text_key: str, limit: int) -> list[str]:
    texts: list[str] = []
    for path in paths:
        for rows, _ in iter_documents(path, text_key, 10_000):
            texts.extend(row[text_key] for row in rows)
            if limit and len(texts) >= limit:
                return texts[:limit]
    return texts


def _split(texts: list[str], keep: int, validation: float, rng) -> tuple[list, list]:
    order = rng.permutation(len(texts))[:keep]
    held = int(round(len(order) * validation))
    return [texts[i] for i in order[held:]], [texts[i] for i in order[:held]]


def train_classifier(
    positive: list[str], negative: list[str], output: str, s: TrainingSettings
) -> tuple[dict, Evaluation | None]:
    """Train on the two classes' texts, save the model to `output` (whole or absent); returns
    (the documents used per class and split, the held-out evaluation or None)."""
    import fasttext

    if not positive or not negative:
        empty = "positive" if not positive else "negative"
        raise ConfigError(f"--{empty}: no documents; give files holding some")
    rng = np.random.default_rng(s.seed)
    size = min(len(positive), len(negative)) if s.balance else None
    pos_train, pos_held = _split(positive, size or len(positive), s.validation, rng)
    neg_train, neg_held = _split(negative, size or len(negative), s.validation, rng)
    if not pos_train or not neg_train:
        raise ConfigError("--validation: leaves no training documents of a class; lower it")
    lines = [f"{LABEL_PREFIX}{s.positive_label} {classifier_text(t)}" for t in pos_train]
    lines += [f"{LABEL_PREFIX}{s.negative_label} {classifier_text(t)}" for t in neg_train]
    lines = [lines[i] for i in rng.permutation(len(lines))]
    folder = _output_folder(output)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        train_file = os.path.join(tmp, "train.txt")
        with open(train_file, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        try:
            model = fasttext.train_supervised(
                input=train_file, epoch=s.epoch, lr=s.lr, dim=s.dim, wordNgrams=s.word_ngrams,
                minCount=s.min_count, thread=s.threads, seed=s.seed, verbose=0,
            )  # fmt: skip
        except (ValueError, RuntimeError) as err:  # e.g. no word reaches --min-count
            raise ConfigError(
                f"fastText cannot train on these documents ({err}); lower --min-count or give "
                "documents with words"
            ) from None
        saved = os.path.join(tmp, "model.bin")
        model.save_model(saved)
        os.replace(saved, output)
    counts = {
        "positive": {"train": len(pos_train), "held_out": len(pos_held), "read": len(positive)},
        "negative": {"train": len(neg_train), "held_out": len(neg_held), "read": len(negative)},
    }
    if not pos_held or not neg_held:
        return counts, None
    return counts, evaluate(output, s.positive_label, pos_held, neg_held)


def _output_folder(output: str) -> str:
    """The folder --output goes to, created; a ConfigError for a folder given as the file or
    a place that cannot be written."""
    if os.path.isdir(output):
        raise ConfigError(f"--output {output}: is a folder; give the model file's path")
    folder = os.path.dirname(os.path.abspath(output))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--output {output}: cannot create {folder} ({err.strerror})") from None
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"--output {output}: {folder} is not writable; give another path")
    return folder


def evaluate(model_path: str, label: str, positive: list[str], negative: list[str]) -> Evaluation:
    model, name = load_fasttext(model_path), LABEL_PREFIX + label
    pos = np.array([label_probability(model, name, t) for t in positive])
    neg = np.array([label_probability(model, name, t) for t in negative])
    true_pos, false_pos = int((pos >= 0.5).sum()), int((neg >= 0.5).sum())
    accuracy = (true_pos + int((neg < 0.5).sum())) / (len(pos) + len(neg))
    precision = true_pos / (true_pos + false_pos) if true_pos + false_pos else 0.0
    # AUC: the share of (positive, negative) pairs ordered right, ties counting half, from
    # the ranks of all scores (Mann-Whitney), not from every pair
    from scipy.stats import rankdata

    ranks = rankdata(np.concatenate([pos, neg]))
    wins = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    auc = float(wins) / (len(pos) * len(neg))
    return Evaluation(len(pos) + len(neg), accuracy, precision, true_pos / len(pos), auc)
