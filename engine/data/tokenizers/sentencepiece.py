"""SentencePiece models: ours (SentencePieceTokenizer) and Llama-2's (Llama2Tokenizer).

Models trained by tools/train_tokenizer.py have fixed special ids: <unk>=0, <s>=1 (bos),
</s>=2 (eos, also the end-of-document token), <pad>=3.
"""

from __future__ import annotations

import json
import os
import shutil

from engine.data.tokenizers.base import Tokenizer, existing_file
from engine.errors import InputError

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


def _present(token_id: int) -> int | None:
    return None if token_id < 0 else token_id


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model: text is encoded as is, with no bos; eos ends a document."""

    add_bos = False

    def __init__(self, model_path: str | os.PathLike | None):
        import sentencepiece

        self.model_path = existing_file(
            model_path and os.fspath(model_path),
            "--tokenizer-model",
            "SentencePiece model",
            "fix the path, or train one with tools/train_tokenizer.py",
        )
        self.source = f"the tokenizer {self.model_path}"
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(self.model_path)
        except (OSError, RuntimeError) as err:
            raise InputError(f"{self.model_path}: not a SentencePiece model ({err})") from None
        self.vocab_size = self._sp.GetPieceSize()
        self.bos = _present(self._sp.bos_id())
        self.eos = _present(self._sp.eos_id())
        self.pad = _present(self._sp.pad_id())
        self.unk = _present(self._sp.unk_id())
        if self.eos is None:
            raise InputError(
                f"{self.model_path}: the model has no eos piece to end documents with; train "
                "it with one (tools/train_tokenizer.py does)"
            )
        self.eod = self.eos

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """One thread: preprocessing parallelises over worker processes instead."""
        encoded = self._sp.Encode(texts, num_threads=1)
        if self.add_bos:
            return [[self.bos, *ids] for ids in encoded]
        return encoded

    def detokenize(self, ids) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.IdToPiece(int(token_id))

    def token_id(self, text: str) -> int | None:
        found = self._sp.PieceToId(text)  # the unknown piece's id when there is none
        return found if self._sp.IdToPiece(found) == text else None

    def save_hf(self, folder: str) -> None:
        """The model file plus a LlamaTokenizer config that encodes as we do (no dummy prefix,
        bos only where we add one)."""
        shutil.copyfile(self.model_path, os.path.join(folder, "tokenizer.model"))
        piece = self._sp.IdToPiece
        tokens = {
            f"{name}_token": piece(token_id)
            for name, token_id in (("bos", self.bos), ("eos", self.eos), ("unk", self.unk))
            if token_id is not None
        }
        if self.pad is not None:
            tokens["pad_token"] = piece(self.pad)
        config = {
            "tokenizer_class": "LlamaTokenizer",
            **tokens,
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "legacy": True,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000,
        }
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=1)
        with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
            json.dump(tokens, f, indent=1)


class Llama2Tokenizer(SentencePieceTokenizer):
    """Llama-2's conventions: every document starts with bos; eos ends it."""

    add_bos = True

    def __init__(self, model_path):
        super().__init__(model_path)
        if self.bos is None:
            raise InputError(f"{self.model_path}: Llama2Tokenizer needs a model with a bos piece")
