"""Optional fast batch encoding with `gigatoken`, used only where it gives the tokenizer's ids.

gigatoken re-implements byte-level BPE (Hugging Face `tokenizer.json`, GPT-2 vocab/merges) and
SentencePiece BPE models in Rust and encodes batches several times faster than `tokenizers` or
`sentencepiece`. It leaves out what a Hugging Face post-processor adds (Llama-3's bos) and
Llama-2's bos; those come back as a fixed prefix and suffix. Before it is used, its ids are
compared with the tokenizer's own on probe texts (code, Unicode, emoji, whitespace runs, the
tokenizer's special tokens written in the text, the empty text); any difference, a tokenizer
family it does not cover, or gigatoken not installed means the tokenizer's own library is used.
The probes place every special token's spelling (a Hugging Face tokenizer's special tokens, a
SentencePiece model's control and unknown pieces) inside words, brackets, quotes,
code and markup: gigatoken 0.10 encodes a SentencePiece model's `<s>` or `<pad>` written in a
document as the control id, where SentencePiece splits it into pieces, so SentencePiece models
fail the probes. Probes cannot prove equality, though: on real corpora one document in 4,008
with a byte-level BPE (a recently assigned Unicode letter) came out with other ids than the
library's. gigatoken is therefore opt-in (--tokenize-with auto or gigatoken, approximate);
preprocessing uses the tokenizer's own library by default.
"""

from __future__ import annotations

import numpy as np

from engine.data.tokenizers.base import PROBE_TEXTS, Tokenizer
from engine.errors import InputError

CHOICES = ("auto", "gigatoken", "tokenizer")


class GigatokenEncoder:
    """Batch encoding to flat ids and per-document lengths, equal to `tokenize_batch`."""

    def __init__(self, encoder, prefix: list[int], suffix: list[int]):
        self.encoder = encoder
        self.prefix = np.asarray(prefix, dtype=np.int64)
        self.suffix = np.asarray(suffix, dtype=np.int64)

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(the documents' ids one after another, each document's length)."""
        layout = self.encoder.encode_batch(texts).layout
        offsets = np.asarray(layout.offsets.data, dtype=np.int64)
        flat = np.asarray(layout.content.data)[offsets[0] : offsets[-1]]
        starts, ends = offsets[:-1] - offsets[0], offsets[1:] - offsets[0]
        n, p, s = len(texts), len(self.prefix), len(self.suffix)
        if s:
            flat = np.insert(flat, np.repeat(ends, s), np.tile(self.suffix, n))
            starts = starts + s * np.arange(n)
        if p:  # equal insertion points keep the order given: the prefix in its order
            flat = np.insert(flat, np.repeat(starts, p), np.tile(self.prefix, n))
        return flat, ends - offsets[:-1] + offsets[0] + p + s


def gigatoken_encoder(tokenizer: Tokenizer, required: bool = False) -> GigatokenEncoder | None:
    """A verified encoder, or None (with `required`, an InputError saying why not)."""

    def unavailable(why: str):
        if required:
            raise InputError(
                f"--tokenize-with gigatoken: {why}; use --tokenize-with tokenizer (or auto)"
            )
        return None

    try:
        import gigatoken
    except ImportError:
        return unavailable("gigatoken is not installed (pip install gigatoken==0.10.0)")
    try:
        encoder = _load(gigatoken, tokenizer)
    except Exception as err:  # gigatoken's own errors for models it cannot read
        return unavailable(f"gigatoken cannot read {tokenizer.source} ({err})")
    if encoder is None:
        return unavailable(f"gigatoken does not cover {type(tokenizer).__name__}")
    probes = PROBE_TEXTS + [" ".join(_special_texts(tokenizer))]
    probes += [place.format(s=s) for s in _special_texts(tokenizer) for place in _PLACES]
    expected = tokenizer.tokenize_batch(probes)
    got = encoder.encode_batch_list(probes, parallel=False)
    affixes = _affixes(expected, got)
    if affixes is None:
        return unavailable(f"gigatoken's ids differ from {tokenizer.source}'s on probe texts")
    return GigatokenEncoder(encoder, *affixes)


def _load(gigatoken, tokenizer: Tokenizer):
    backend = getattr(tokenizer, "_backend", None)
    if backend is not None:  # Hugging Face and GPT-2 BPE: the `tokenizers` model as JSON
        return gigatoken.Tokenizer.from_json(backend.to_str())
    model_path = getattr(tokenizer, "model_path", None)
    if model_path is not None:  # SentencePiece and Llama-2 (BPE models with byte fallback)
        return gigatoken.Tokenizer.from_sentencepiece(model_path)
    return None


# where a special token's spelling can sit in a real document: inside a word, in brackets and
# quotes, in code and markup, doubled, at a line's end
_PLACES = ("a{s}b", "x{s}", "{s}y", "({s})", "f('{s}', 1)", "<{s}>", "{s}{s}", "é{s}é\n")


def _special_texts(tokenizer: Tokenizer) -> list[str]:
    """The spellings of the tokenizer's special tokens: a Hugging Face tokenizer's special
    tokens, a SentencePiece model's control and unknown pieces."""
    hf = getattr(tokenizer, "_hf", None)
    out = list(getattr(hf, "all_special_tokens", []) or [])
    sp = getattr(tokenizer, "_sp", None)
    if sp is not None:
        out += [
            sp.IdToPiece(i) for i in range(sp.GetPieceSize()) if sp.IsControl(i) or sp.IsUnknown(i)
        ]
    return out


def _affixes(expected: list[list[int]], got: list[list[int]]):
    """(prefix, suffix) such that every expected == prefix + got + suffix, or None."""
    around = expected[0][len(got[0]) :] if expected[0][: len(got[0])] == got[0] else None
    if around is None or got[0]:
        return None
    for cut in range(len(around) + 1):
        prefix, suffix = around[:cut], around[cut:]
        if all(e == prefix + g + suffix for e, g in zip(expected, got, strict=False)):
            return prefix, suffix
    return None
