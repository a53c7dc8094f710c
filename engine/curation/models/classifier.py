"""Model-based filtering with a fastText classifier (DCLM's quality filter; the same stage with
a toxic/non-toxic model as a toxicity filter).

A document's score is the probability the model gives one of its labels (`label`, written
without fastText's `__label__` prefix), for the document's text with its lines joined by
spaces (fastText reads one line; DCLM joins them so). The score is written to the document
as a field (`field`) whether it is kept or removed:

    quality_classifier:below_threshold     the score is below `threshold`
    toxicity_classifier:above_threshold    the score is at least `threshold`

tools/train_quality_classifier.py trains such a model from positive and negative documents.
A fastText model file holds arrays, not code: loading one runs nothing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from engine.errors import ConfigError, InputError

FASTTEXT_MAGIC = 793712314  # the first 4 bytes of a fastText .bin (little-endian int32)
LABEL_PREFIX = "__label__"


@dataclass(frozen=True)
class QualityClassifier:
    model: str = ""  # a fastText .bin (tools/train_quality_classifier.py writes one)
    label: str = "hq"  # the label whose probability is the score (DCLM's positive label)
    threshold: float = 0.5  # documents scoring below it are removed
    field: str = "quality_score"  # the field the score is written to

    removes_above = False  # a document is removed below the threshold

    def __post_init__(self):
        _check_threshold(self.threshold)

    def check(self, where: str) -> None:
        check_model(self.model, self.label, where)


@dataclass(frozen=True)
class ToxicityClassifier:
    model: str = ""  # a fastText .bin trained on toxic and non-toxic documents
    label: str = "toxic"  # the label whose probability is the score
    threshold: float = 0.5  # documents scoring at least this are removed
    field: str = "toxicity_score"

    removes_above = True

    def __post_init__(self):
        _check_threshold(self.threshold)

    def check(self, where: str) -> None:
        check_model(self.model, self.label, where)


def _check_threshold(threshold: float) -> None:
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold {threshold} is not between 0 and 1")


def check_model(path: str, label: str, where: str) -> None:
    """A ConfigError unless `path` is a fastText model file with the label (loaded once here,
    so that a wrong model is refused before the run writes anything)."""
    _check_magic(path, where)
    _full_label(load_fasttext(path), path, label, where)


def _full_label(model, path: str, label: str, where: str) -> str:
    full = LABEL_PREFIX + label.removeprefix(LABEL_PREFIX)
    if full not in model.labels:
        labels = ", ".join(x.removeprefix(LABEL_PREFIX) for x in model.labels)
        raise ConfigError(
            f"{where}.label {label!r}: not a label of {path} (its labels: {labels}); give one "
            "of them"
        )
    return full


def _check_magic(path: str, where: str) -> None:
    if not path:
        raise ConfigError(
            f"{where}: on without a model; give model: path/to/classifier.bin "
            "(tools/train_quality_classifier.py trains one)"
        )
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as err:
        raise ConfigError(f"{where}: model {path}: cannot read it ({err.strerror})") from None
    if len(head) < 4 or struct.unpack("<i", head)[0] != FASTTEXT_MAGIC:
        raise ConfigError(
            f"{where}: model {path} is not a fastText model file (.bin); give the file "
            "fasttext's save_model wrote"
        )


def classifier_text(text: str) -> str:
    """The text a fastText classifier reads for a document: its lines joined by spaces."""
    return " ".join(text.strip().splitlines())


def label_probability(model, label: str, text: str) -> float:
    """The model's probability of `label` (with its prefix) for the document's text."""
    labels, probabilities = model.predict(classifier_text(text), k=-1, threshold=0.0)
    return float(dict(zip(labels, probabilities, strict=True)).get(label, 0.0))


def load_fasttext(path: str):
    try:
        import fasttext  # noqa: F401
    except ImportError as err:  # pinned in requirements.txt; a broken install only
        raise ImportError(
            "the classifier stages need fasttext (pip install fasttext-numpy2-wheel==0.9.2)"
        ) from err
    from fasttext.FastText import _FastText

    try:
        return _FastText(model_path=path)  # load_model, without its notice on stderr
    except ValueError as err:
        raise InputError(f"{path}: not a fastText model ({err}); retrain or re-copy it") from None


class ClassifierScorer:
    """`score(text)` -> the probability of the stage's label; `reason(score)` -> the removal
    reason or None. The model is loaded once per shard."""

    def __init__(self, stage: str, params: QualityClassifier | ToxicityClassifier):
        self.stage, self.params = stage, params
        self.model = load_fasttext(params.model)
        self.label = _full_label(self.model, params.model, params.label, stage)

    def score(self, text: str) -> float:
        # fastText's softmax can exceed 1 by rounding: a probability stays within [0, 1]
        return min(1.0, max(0.0, label_probability(self.model, self.label, text)))

    def reason(self, score: float) -> str | None:
        if self.params.removes_above:
            return f"{self.stage}:above_threshold" if score >= self.params.threshold else None
        return f"{self.stage}:below_threshold" if score < self.params.threshold else None
