"""The interface every tokenizer family has (Megatron-LM's names: tokenize, detokenize, eod)."""

from __future__ import annotations

import os

from engine.errors import InputError


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

    def save_hf(self, folder: str) -> None:
        """Write the files with which transformers' AutoTokenizer.from_pretrained(folder)
        encodes every text to the ids tokenize gives."""
        raise NotImplementedError

    def special_ids(self) -> dict:
        """bos / eos / pad / unk ids for a Hugging Face config (absent ones left out)."""
        ids = {"bos": self.bos, "eos": self.eos, "pad": self.pad, "unk": self.unk}
        return {k: v for k, v in ids.items() if v is not None}


def existing_file(path: str | None, flag: str, what: str, fix: str = "fix the path") -> str:
    """path, which must name a file; InputError naming the flag otherwise."""
    if not path:
        raise InputError(f"{flag} is required: the {what}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InputError(f"{flag} {path}: no such file (the {what}); {fix}")
    return path
