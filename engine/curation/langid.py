"""Language identification with py3langid (langid.py's model, shipped inside the package as
numpy arrays: nothing is downloaded and nothing loaded runs code)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Language:
    languages: tuple[str, ...] = ("en",)  # ISO 639-1 codes kept
    min_score: float = 0.65  # the identified language's probability (FineWeb's threshold)
    output_per_language: bool = False  # kept shards under kept/<language>/

    def __post_init__(self):
        if not 0.0 <= self.min_score <= 1.0:
            raise ValueError(f"min_score {self.min_score} is not between 0 and 1")


class LanguageIdentifier:
    """`identify(text)` -> (language code, probability)."""

    def __init__(self):
        try:
            from py3langid.langid import MODEL_FILE
            from py3langid.langid import LanguageIdentifier as Model
        except ImportError as err:  # pinned in requirements.txt; a broken install only
            raise ImportError(
                "language identification needs py3langid (pip install py3langid==0.4.0)"
            ) from err
        self.model = Model.from_model_file(MODEL_FILE, norm_probs=True)

    def identify(self, text: str) -> tuple[str, float]:
        language, score = self.model.classify(text)
        return language, float(score)


def language_reason(
    text: str, c: Language, identifier: LanguageIdentifier
) -> tuple[str | None, str, float]:
    """(reason or None, language, score)."""
    language, score = identifier.identify(text)
    if language not in c.languages:
        return "language:other", language, score
    if score < c.min_score:
        return "language:low_score", language, score
    return None, language, score
