"""NullTokenizer: the text already is token ids, written as integers separated by spaces.

For trying a launch with no real tokenizer (with --mock-data, or on data preprocessed from
ids). Megatron-LM's conventions: --vocab-size N ids, the last of them (N - 1) ends a document
unless --null-tokenizer-eod-id says otherwise; with --legacy-tokenizer there are N + 1 ids and
N ends a document.
"""

from __future__ import annotations

import json
import os

from engine.data.tokenizers.base import Tokenizer
from engine.errors import ConfigError, InputError


class NullTokenizer(Tokenizer):
    def __init__(self, vocab_size: int | None, eod_id: int | None = None, legacy: bool = False):
        if not vocab_size or vocab_size < 1:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size N (N >= 1)")
        self.vocab_size = vocab_size + 1 if legacy else vocab_size
        self.eod = self.vocab_size - 1 if eod_id is None else eod_id
        if not 0 <= self.eod < self.vocab_size:
            raise ConfigError(
                f"--null-tokenizer-eod-id {eod_id} is outside the vocabulary "
                f"0..{self.vocab_size - 1}"
            )
        self.eos = self.eod
        self.source = f"NullTokenizer --vocab-size {vocab_size}"

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._ids(text) for text in texts]

    def _ids(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                token_id = int(word)
            except ValueError:
                token_id = -1
            if not 0 <= token_id < self.vocab_size:
                raise InputError(
                    f"NullTokenizer reads token ids 0..{self.vocab_size - 1} written as integers "
                    f"separated by spaces; found {word[:40]!r}"
                )
            ids.append(token_id)
        return ids

    def identity(self) -> str:
        """Its ids are its input: the vocabulary size and EOD are all it is."""
        return f"NullTokenizer vocab {self.vocab_size} eod {self.eod}"

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def save_hf(self, folder: str) -> None:
        """A word-level tokenizer whose words are the ids themselves."""
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {str(i): i for i in range(self.vocab_size)}
        backend = RustTokenizer(models.WordLevel(vocab=vocab, unk_token=str(self.eod)))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
        hf = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=str(self.eod))
        hf.save_pretrained(folder)
        with open(os.path.join(folder, "null_tokenizer.json"), "w") as f:
            json.dump({"vocab_size": self.vocab_size, "eod_id": self.eod}, f)
