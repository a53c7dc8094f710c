"""The interface every tokenizer family has (Megatron-LM's names: tokenize, detokenize, eod)."""

from __future__ import annotations

import copy
import hashlib
import json
import os

from engine.errors import InputError

# Texts that exercise a tokenizer: code and whitespace, digits, accents and scripts, emoji,
# contractions, a long run of one letter.
PROBE_TEXTS = [
    "",
    "def f(x):\n    return x  # comment\n\n\n",
    "Hello, world! 123 4567 89.0e-3",
    "naïve café — Ünïcödé, 日本語のテキスト, 한국어, Ελληνικά, עברית",
    "emoji 😀👍🏽 and ZWJ 👨‍👩‍👧 sequences",
    "   leading and trailing spaces   \t\ttabs\r\nwindows line",
    "x" * 300,
    "'s 've 're 'll 'd IT'S",
]


class Tokenizer:
    """Text <-> token ids. Subclasses set the special ids they have (None where absent) and
    implement tokenize_batch, detokenize and save_hf."""

    vocab_size: int
    eod: int
    bos: int | None = None
    eos: int | None = None
    pad: int | None = None
    unk: int | None = None
    #: what error messages call it, e.g. "the tokenizer data/tokenizer.json"
    source: str = "the tokenizer"

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    def token_id(self, text: str) -> int | None:
        """The id of the one token spelled `text` (a special token such as <fim_prefix>), or
        None where the vocabulary has no such token."""
        return None

    def save_hf(self, folder: str) -> None:
        """Write the files with which transformers' AutoTokenizer.from_pretrained(folder)
        encodes every text to the ids tokenize gives."""
        raise NotImplementedError

    def identity(self) -> str:
        """A digest of what the tokenizer does, not of where its files are: its ids for the
        probe texts, its vocabulary size and its special ids. Two tokenizers with one identity
        encode those texts alike; data packed with one resumes with the other."""
        ids = self.tokenize_batch(PROBE_TEXTS)
        record = [ids, self.vocab_size, self.eod, self.special_ids()]
        return hashlib.sha256(json.dumps(record).encode()).hexdigest()

    def special_ids(self) -> dict:
        """bos / eos / pad / unk ids for a Hugging Face config (absent ones left out)."""
        ids = {"bos": self.bos, "eos": self.eos, "pad": self.pad, "unk": self.unk}
        return {k: v for k, v in ids.items() if v is not None}


def plain(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer encoding text alone, without the BOS/EOS it may add (for pieces of text
    joined to others: the harness's contexts and continuations, fill-in-the-middle parts)."""
    out = copy.copy(tokenizer)
    if hasattr(out, "add_bos"):
        out.add_bos = False
    if hasattr(out, "add_special_tokens"):
        out.add_special_tokens = False
    return out


def existing_file(path: str | None, flag: str, what: str, fix: str = "fix the path") -> str:
    """path, which must name a file; InputError naming the flag otherwise."""
    if not path:
        raise InputError(f"{flag} is required: the {what}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InputError(f"{flag} {path}: no such file (the {what}); {fix}")
    return path
