"""Tokenizers the engine reads data with. SentencePiece is the one we train and ship.

Special-token ids are fixed by tools/train_tokenizer.py: <unk>=0, <s>=1 (bos), </s>=2 (eos,
also the end-of-document token "eod"), <pad>=3.
"""

from __future__ import annotations

import os

from engine.errors import ConfigError, InputError

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")


class SentencePieceTokenizer:
    """A SentencePiece model with Megatron-LM's tokenizer interface (tokenize, eod, ...)."""

    def __init__(self, model_path: str | os.PathLike):
        import sentencepiece

        self.model_path = os.fspath(model_path)
        if not os.path.isfile(self.model_path):
            raise InputError(
                f"{self.model_path}: no such tokenizer model; train one with "
                "tools/train_tokenizer.py or fix --tokenizer-model"
            )
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(self.model_path)
        except (OSError, RuntimeError) as err:
            raise InputError(f"{self.model_path}: not a SentencePiece model ({err})") from None

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    @property
    def unk(self) -> int:
        return self._sp.unk_id()

    def tokenize(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts in one call; one thread, since workers are processes."""
        return self._sp.Encode(texts, num_threads=1)

    def detokenize(self, ids) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.IdToPiece(int(token_id))


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None) -> SentencePieceTokenizer:
    """The tokenizer named by --tokenizer-type / --tokenizer-model."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ConfigError(
            f"--tokenizer-type {tokenizer_type} is not supported; use SentencePieceTokenizer"
        )
    if not tokenizer_model:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model PATH")
    return SentencePieceTokenizer(tokenizer_model)
