"""Perplexity under CCNet's KenLM models, for users who have them (CCNet trained one n-gram
model per language on Wikipedia: `<lang>.arpa.bin` with its SentencePiece model
`<lang>.sp.model`; the edugp/kenlm collection on the Hugging Face hub holds the same layout).

A document is scored as CCNet scored it: its text normalised as the models' training text was
(stripped, lower-cased, accents removed, every digit made 0, CJK and typographic punctuation
mapped to ASCII, control characters, line breaks included, removed), cut into SentencePiece
pieces, the pieces scored by KenLM as one sentence (with <s> and </s>); the perplexity is
10^(-log10 probability / (pieces + 1)), rounded to 0.1 as CCNet wrote it. Tested equal to
CCNet's own code (cc_net 1.0.0, tests/test_curate_kenlm.py).

kenlm is an optional dependency (`pip install kenlm==0.3.0`); loading a model runs no code.
"""

from __future__ import annotations

import os
import re
import unicodedata

from engine.errors import ConfigError, InputError

MODEL_SUFFIXES = (".arpa.bin", ".arpa", ".bin")
# CJK and typographic punctuation -> the ASCII CCNet's models saw (the same table as CCNet's)
_PUNCTUATION = dict(
    zip(
        "，。、„”“«»１」「《》´∶：？！（）；–—．～’…━〈〉【】％►",
        [",", ".", ",", '"', '"', '"', '"', '"', '"', '"', '"', '"', '"', "'", ":", ":", "?",
         "!", "(", ")", ";", "-", " - ", ". ", "~", "'", "...", "-", "<", ">", "[", "]", "%",
         "-"],
        strict=True,
    )
)  # fmt: skip
_PUNCTUATION_TABLE = str.maketrans(_PUNCTUATION)
_CONTROL = re.compile("[" + "".join(map(chr, [*range(32), *range(127, 160)])) + "]")
_DIGIT = re.compile(r"\d")


def ccnet_normalize(text: str) -> str:
    """The text as CCNet normalised it before SentencePiece."""
    text = text.strip()
    if not text:
        return text
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(c for c in text if unicodedata.category(c) != "Mn")
    text = _DIGIT.sub("0", text).translate(_PUNCTUATION_TABLE)
    return _CONTROL.sub("", text)


def model_files(folder: str, language: str) -> tuple[str, str] | None:
    """(KenLM model, SentencePiece model) of `language` in the folder, or None."""
    tokenizer = os.path.join(folder, f"{language}.sp.model")
    for suffix in MODEL_SUFFIXES:
        model = os.path.join(folder, language + suffix)
        if os.path.isfile(model) and os.path.isfile(tokenizer):
            return model, tokenizer
    return None


def check_folder(folder: str, languages: tuple[str, ...], where: str) -> None:
    """kenlm importable, and a model and a tokenizer for each language the run keeps."""
    try:
        import kenlm  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{where}: kenlm {folder} needs the kenlm package; pip install kenlm==0.3.0"
        ) from None
    if not os.path.isdir(folder):
        raise ConfigError(f"{where}: kenlm {folder} is not a folder; give CCNet's model folder")
    missing = [x for x in languages if model_files(folder, x) is None]
    if missing:
        raise ConfigError(
            f"{where}: kenlm {folder} has no <lang>.arpa.bin (or .arpa) with <lang>.sp.model "
            f"for {', '.join(missing)}; add them or keep other languages (language.languages)"
        )
    for language in languages:  # the files' first bytes (a model is loaded by each task)
        model, _ = model_files(folder, language)
        with open(model, "rb") as f:
            start = f.read(256).lstrip()
        if not start.startswith((b"mmap lm ", b"\\data\\")):
            raise ConfigError(
                f"{where}: {model} is neither a KenLM binary nor an ARPA file; give the model "
                "KenLM's build_binary or lmplz wrote"
            )


class KenlmScorer:
    """`score(text, language)` -> CCNet's perplexity of the document under its language's
    model (each language's models loaded when a document of it first comes)."""

    def __init__(self, folder: str):
        self.folder = folder
        self.models: dict[str, tuple] = {}

    def _models(self, language: str) -> tuple:
        if language not in self.models:
            import kenlm
            import sentencepiece

            files = model_files(self.folder, language)
            if files is None:
                raise InputError(
                    f"perplexity.kenlm {self.folder}: a document in {language!r} and no model "
                    f"{language}.arpa.bin with {language}.sp.model; add them, or keep only "
                    "languages with models (language.languages)"
                )
            try:
                model = kenlm.Model(files[0])
            except (OSError, RuntimeError) as err:
                raise InputError(f"{files[0]}: KenLM cannot load it ({err})") from None
            pieces = sentencepiece.SentencePieceProcessor(model_file=files[1])
            self.models[language] = (model, pieces)
        return self.models[language]

    def score(self, text: str, language: str) -> float:
        model, pieces = self._models(language)
        tokens = pieces.encode(ccnet_normalize(text), out_type=str)
        log10 = model.score(" ".join(tokens), bos=True, eos=True)
        return round(10.0 ** (-log10 / (len(tokens) + 1)), 1)
