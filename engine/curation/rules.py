"""Step 1's per-document stages for one worker and one shard: a page's URL rules and main text,
then language ID, Gopher, C4, FineWeb, bad words, the classifiers and decontamination. The
first rule a document fails removes it. The values the stages compute are written to the
document as fields (`Judged.fields`), on removed documents too, as far as it went (the
perplexity is scored after the deduplication: engine/curation/models/perplexity_steps.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.curation.bad_words import BadWordsMatcher
from engine.curation.config import CurateConfig
from engine.curation.decontamination import ContaminationIndex
from engine.curation.langid import LanguageIdentifier, language_reason
from engine.curation.models.classifier import ClassifierScorer
from engine.curation.quality import c4, fineweb, gopher_quality, gopher_repetition
from engine.curation.text import words
from engine.curation.web.extract import PageExtractor
from engine.curation.web.urls import URLRules

GOPHER_RULES = (("gopher_repetition", gopher_repetition), ("gopher_quality", gopher_quality))
CLASSIFIERS = ("quality_classifier", "toxicity_classifier")


def added_fields(config: CurateConfig) -> dict:
    """The fields the run's stages add to documents, with their Arrow types (a Parquet input's
    schema is extended by them)."""
    import pyarrow as pa

    out = {}
    if config.stage("language"):
        out.update(language=pa.string(), language_score=pa.float64())
    for name in CLASSIFIERS:
        if config.stage(name):
            out[config.stage(name).field] = pa.float64()
    if config.stage("perplexity"):
        out.update(perplexity=pa.float64(), perplexity_bucket=pa.string())
    return out


def with_fields(schema, fields: dict):
    """`schema` (or None) with `fields` set: appended, or retyped where the input had them."""
    import pyarrow as pa

    if schema is None:
        return None
    for name, kind in fields.items():
        at = schema.get_field_index(name)
        new = pa.field(name, kind)
        schema = schema.set(at, new) if at >= 0 else schema.append(new)
    return schema


@dataclass
class Judged:
    reason: str | None  # None: kept
    text: str  # the text kept (a page's extracted text, C4's lines dropped)
    fields: dict = field(default_factory=dict)


class DocumentRules:
    """The stages of one shard (models, lists and evaluation n-grams loaded once)."""

    def __init__(self, config: CurateConfig, work: str):
        self.config = s = config.stage
        self.urls = URLRules(s("url_filter")) if s("url_filter") is not None else None
        self.extract = PageExtractor(s("extraction")) if s("extraction") is not None else None
        self.language = s("language")
        self.identifier = LanguageIdentifier() if self.language else None
        self.bad_words = BadWordsMatcher(s("bad_words")) if s("bad_words") else None
        self.classifiers = [ClassifierScorer(n, s(n)) for n in CLASSIFIERS if s(n)]
        self.contamination = None
        if s("decontamination") is not None:  # built once by curate()
            path = os.path.join(work, "contamination.npy")
            self.contamination = ContaminationIndex.load(path, s("decontamination").ngram)

    def web(self, row: dict, text: str) -> Judged:
        """A row's URL rules (any row with a `url`), then an HTML page's main text (WARC input;
        a page the extraction stage is off for is kept as HTML)."""
        url = row.get("url")
        reason = self.urls.reason(url) if self.urls is not None and isinstance(url, str) else None
        if reason:
            return Judged(reason, text)
        if self.extract is not None and row.get("warc_type") == "html":
            reason, extracted = self.extract(text)
            return Judged(reason, extracted if reason is None else text)
        return Judged(None, text)

    def apply(self, text: str, row: dict) -> Judged:
        """The per-document stages on `text` (the row's other fields: its language, when the
        language stage is off and the input has one)."""
        s, fields = self.config, {}
        language = row.get("language") if isinstance(row.get("language"), str) else None
        if self.language:
            reason, language, score = language_reason(text, self.language, self.identifier)
            fields.update(language=language, language_score=score)
            if reason:
                return Judged(reason, text, fields)
        gopher = [(n, rule) for n, rule in GOPHER_RULES if s(n)]
        tokens = words(text) if gopher else None  # split once for both rule sets
        for name, rule in gopher:
            if reason := rule(text, s(name), tokens):
                return Judged(reason, text, fields)
        if s("c4"):
            reason, text = c4(text, s("c4"))
            if reason:
                return Judged(reason, text, fields)
        if s("fineweb") and (reason := fineweb(text, s("fineweb"))):
            return Judged(reason, text, fields)
        if self.bad_words is not None and (reason := self.bad_words.reason(text, language)):
            return Judged(reason, text, fields)
        for classifier in self.classifiers:
            score = classifier.score(text)
            fields[classifier.params.field] = score
            if reason := classifier.reason(score):
                return Judged(reason, text, fields)
        if self.contamination is not None and self.contamination.contaminated(text):
            return Judged("decontamination:ngram", text, fields)
        return Judged(None, text, fields)
