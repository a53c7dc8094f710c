"""tools/curate.py's configuration: one YAML or JSON file whose keys are the stages.

Every stage has the published defaults (see each stage's module); the file only says what
differs. A stage is turned off with `false` (or `enabled: false`) and on with `true` or a
mapping of its parameters:

    text_key: text               # the field holding the document's text
    documents_per_part: 10000    # documents a worker holds at once (one output file each)
    url_filter: {blocklists: [ut1/], banned_words: banned.txt}   # off unless given lists
    extraction: {extractor: resiliparse}  # WARC pages: trafilatura (the default) or this
    language: {languages: [en, fr], min_score: 0.5, output_per_language: true}
    c4: {terminal_punctuation: false}     # FineWeb's choice
    bad_words: {lists: ldnoobw/}          # off unless given lists
    quality_classifier: {model: quality.bin, threshold: 0.5}   # off unless given a model
    toxicity_classifier: {model: toxic.bin, label: toxic}      # likewise
    decontamination: {files: [eval/hellaswag.jsonl], keys: [ctx]}
    minhash: {threshold: 0.7}
    perplexity: {model: reference-lm/, keep: [head, middle]}  # off unless given a model
    # (or kenlm: ccnet-models/, CCNet's <lang>.arpa.bin and <lang>.sp.model)
    pii: false
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from engine.curation.bad_words import BadWords
from engine.curation.decontamination import Decontamination
from engine.curation.langid import Language
from engine.curation.minhash import MinHashConfig
from engine.curation.models.classifier import QualityClassifier, ToxicityClassifier
from engine.curation.models.perplexity import Perplexity
from engine.curation.pii import PII
from engine.curation.quality import C4, FineWeb, GopherQuality, GopherRepetition
from engine.curation.web.extract import Extraction
from engine.curation.web.urls import URLFilter
from engine.errors import ConfigError
from engine.files.structured import read_yaml_or_json


@dataclass(frozen=True)
class ExactDedup:
    documents: bool = True  # documents whose normalised text was seen before
    lines: bool = True  # lines seen before anywhere in the corpus (CCNet, used by LLaMA)


# in the order they run: the web stages (a page's URL, its HTML's main text), the per-document
# rules and models, then the corpus-wide deduplication, the perplexity buckets (scored with the
# per-document stages, decided over the deduplicated corpus), then PII
STAGES = {
    "url_filter": (URLFilter, False),
    "extraction": (Extraction, True),
    "language": (Language, True),
    "gopher_repetition": (GopherRepetition, True),
    "gopher_quality": (GopherQuality, True),
    "c4": (C4, True),
    "fineweb": (FineWeb, True),
    "bad_words": (BadWords, False),
    "quality_classifier": (QualityClassifier, False),
    "toxicity_classifier": (ToxicityClassifier, False),
    "decontamination": (Decontamination, False),
    "exact_dedup": (ExactDedup, True),
    "minhash": (MinHashConfig, True),
    "perplexity": (Perplexity, False),
    "pii": (PII, True),
}


@dataclass(frozen=True)
class CurateConfig:
    text_key: str = "text"
    documents_per_part: int = 10_000
    stages: dict = field(
        default_factory=lambda: {n: cls() for n, (cls, on) in STAGES.items() if on}
    )

    def stage(self, name: str):
        """The stage's parameters, or None when it is off."""
        return self.stages.get(name)

    def record(self) -> dict:
        return {
            "text_key": self.text_key,
            "documents_per_part": self.documents_per_part,
            "stages": {n: dataclasses.asdict(p) for n, p in self.stages.items()},
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.record(), sort_keys=True).encode()).hexdigest()


def _value(where: str, field: dataclasses.Field, default, value):
    """`value` checked against the field: its default's type (tuples from lists), and null
    only where the field allows it (a rule that can be turned off, a kind of PII kept)."""
    if value is None:
        if "None" not in str(field.type):
            raise ConfigError(f"{where}: null is not allowed here; give a value")
        return None
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} is not true or false")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: {value!r} is not a list")
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    if isinstance(default, str) or "str" in str(field.type):
        if not isinstance(value, str):
            raise ConfigError(f"{where}: {value!r} is not a string")
        return value
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(f"{where}: {value!r} is not a number (or null to turn the rule off)")
    if "float" not in str(field.type) and not float(value).is_integer():
        raise ConfigError(f"{where}: {value!r} is not a whole number")
    return value


def _stage(path: str, name: str, value):
    cls, on = STAGES[name]
    if isinstance(value, bool):
        return cls() if value else None
    if value is None:
        return cls() if on else None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {name} is {value!r}; give true, false or its parameters")
    value = dict(value)
    if not value.pop("enabled", True):
        return None
    defaults = cls()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ConfigError(
            f"{path}: {name} has no parameter {unknown[0]!r} (its parameters: "
            f"{', '.join(sorted(fields))})"
        )
    given = {
        k: _value(f"{path}: {name}.{k}", fields[k], getattr(defaults, k), v)
        for k, v in value.items()
    }
    try:
        return dataclasses.replace(defaults, **given)
    except ValueError as err:  # the stage's own range checks
        raise ConfigError(f"{path}: {name}: {err}") from None


def _check_fields(stages: dict, text_key: str, where: str) -> None:
    """The classifiers' score fields name new fields, one each."""
    taken = {text_key, "curate_reason", "language", "language_score", "perplexity",
             "perplexity_bucket"}  # fmt: skip
    for name in ("quality_classifier", "toxicity_classifier"):
        params = stages.get(name)
        if params is None:
            continue
        if params.field in taken:
            raise ConfigError(
                f"{where}: {name}.field {params.field!r} is taken (by the text or another "
                "stage); give another field name"
            )
        taken.add(params.field)


def config_from_record(record: dict, where: str) -> CurateConfig:
    """The configuration CurateConfig.record() wrote (a run's curate.json)."""
    stages = {name: _stage(where, name, params) for name, params in record["stages"].items()}
    return CurateConfig(record["text_key"], record["documents_per_part"], stages)


def read_config(path: str | None) -> CurateConfig:
    """The configuration of the file at `path` (None: every default)."""
    if path is None:
        return CurateConfig()
    raw = read_yaml_or_json(path, "--config")
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: not a mapping of stage names to parameters")
    unknown = sorted(set(raw) - set(STAGES) - {"text_key", "documents_per_part"})
    if unknown:
        raise ConfigError(
            f"--config {path}: no stage {unknown[0]!r} (stages: {', '.join(STAGES)}; and "
            "text_key, documents_per_part)"
        )
    per_part = raw.get("documents_per_part", CurateConfig.documents_per_part)
    if not isinstance(per_part, int) or isinstance(per_part, bool) or per_part < 1:
        raise ConfigError(f"--config {path}: documents_per_part {per_part!r} is not a count >= 1")
    text_key = raw.get("text_key", "text")
    if not isinstance(text_key, str):
        raise ConfigError(f"--config {path}: text_key {text_key!r} is not a field name")
    stages = {}
    for name, (cls, on) in STAGES.items():
        given = raw.get(name)
        params = _stage(f"--config {path}", name, given) if name in raw else (cls() if on else None)
        if params is not None:
            stages[name] = params
    for name, params in stages.items():  # files the stage needs (a model, a list folder)
        if hasattr(params, "check"):
            params.check(f"--config {path}: {name}")
    _check_fields(stages, text_key, f"--config {path}")
    perplexity, language = stages.get("perplexity"), stages.get("language")
    if perplexity is not None and perplexity.cutoffs and language and len(language.languages) > 1:
        raise ConfigError(
            f"--config {path}: perplexity.cutoffs are one language's; keep one language "
            "(language.languages) or leave cutoffs out to compute them per language"
        )
    for name in ("bad_words", "perplexity"):  # a list or a model for each language kept
        if name in stages:
            kept = language.languages if language else (stages[name].default_language,)
            stages[name].check_languages(kept, f"--config {path}: {name}")
    url_filter = stages.get("url_filter")
    if url_filter is not None and not url_filter.has_lists:
        raise ConfigError(
            f"--config {path}: url_filter is on without lists; give blocklists or word lists "
            "(banned_words, soft_banned_words, banned_subwords), or leave it off"
        )
    return CurateConfig(text_key, per_part, stages)
