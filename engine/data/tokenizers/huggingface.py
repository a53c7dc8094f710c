"""Tokenizers run by Hugging Face's `tokenizers` (Rust): a Hugging Face folder or tokenizer.json
(HuggingFaceTokenizer) and GPT-2's vocab.json + merges.txt (GPT2BPETokenizer).

Batches are encoded in Rust, which also spreads a batch over threads when the process has
more than one core to itself. Nothing here runs code from the files it reads: transformers is
asked for local files only and never to trust remote code.
"""

from __future__ import annotations

import json
import os

from engine.data.tokenizers.base import Tokenizer, existing_file
from engine.errors import ConfigError, InputError
from parallel.errors import one_line

GPT2_EOD = "<|endoftext|>"


class _RustTokenizer(Tokenizer):
    """Shared by both families: a transformers PreTrainedTokenizerFast around a `tokenizers`
    Tokenizer. Subclasses set self._hf, self.add_special_tokens and call _set_specials."""

    add_special_tokens = True

    def _set_specials(self, eod_token: str | None) -> None:
        hf = self._hf
        self._backend = hf.backend_tokenizer
        self.vocab_size = len(hf)
        self.bos, self.eos = hf.bos_token_id, hf.eos_token_id
        self.pad, self.unk = hf.pad_token_id, hf.unk_token_id
        if eod_token is not None:
            eod = self._backend.token_to_id(eod_token)
            if eod is None:
                raise ConfigError(
                    f"--tokenizer-eod-token {eod_token!r} is not a token of {self.source}; "
                    "give one of its tokens"
                )
            self.eod = eod
            if self.eos is None:  # the export then names it, so generation stops there
                hf.eos_token = eod_token
                self.eos = eod
        elif self.eos is not None:
            self.eod = self.eos
        else:
            raise ConfigError(
                f"{self.source} has no eos token to end documents with; name one with "
                "--tokenizer-eod-token TOKEN (for example <|endoftext|>)"
            )

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=self.add_special_tokens)]

    def detokenize(self, ids) -> str:
        return self._hf.decode([int(i) for i in ids])

    def token_id(self, text: str) -> int | None:
        return self._backend.token_to_id(text)

    def save_hf(self, folder: str) -> None:
        self._hf.save_pretrained(folder)
        if not self.add_special_tokens:
            _drop_added_specials(folder)


def _drop_added_specials(folder: str) -> None:
    """Make the saved tokenizer encode without its own special tokens, as training did with
    --tokenizer-hf-no-include-special-tokens: no post-processor, no bos or eos flags."""
    for name, drop in (
        ("tokenizer.json", {"post_processor": None}),
        ("tokenizer_config.json", {"add_bos_token": False, "add_eos_token": False}),
    ):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                content = json.load(f)
            content.update(drop)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(content, f, ensure_ascii=False, indent=1)


class HuggingFaceTokenizer(_RustTokenizer):
    """--tokenizer-model: a local Hugging Face tokenizer folder, or a bare tokenizer.json."""

    def __init__(
        self,
        path: str | None,
        include_special_tokens: bool = True,
        eod_token: str | None = None,
    ):
        if not path:
            raise ConfigError(
                "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a local folder "
                "with tokenizer.json, or the tokenizer.json file)"
            )
        self.path = os.fspath(path)
        self.source = f"the tokenizer {self.path}"
        self.add_special_tokens = include_special_tokens
        self._hf = _load_folder(self.path) if os.path.isdir(self.path) else _load_file(self.path)
        self._set_specials(eod_token)


def _load_folder(folder: str):
    from transformers import AutoTokenizer

    config_path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config_path):
        config = _read_json(config_path)
        if isinstance(config, dict) and config.get("auto_map"):
            raise InputError(
                f"{config_path}: the tokenizer needs its own Python code (auto_map), which this "
                "engine never runs; use a folder with a plain tokenizer.json"
            )
    try:
        hf = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # tokenizers raises its own Exception subclass for bad JSON
        raise InputError(
            f"{folder}: not a Hugging Face tokenizer folder transformers can load offline "
            f"({one_line(err)})"
        ) from None
    if not hf.is_fast:
        raise InputError(
            f"{folder}: transformers loaded only a slow (Python) tokenizer; add the folder's "
            "tokenizer.json (save it with a fast tokenizer) so batches encode in Rust"
        )
    return hf


def _load_file(path: str):
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    existing_file(path, "--tokenizer-model", "Hugging Face tokenizer.json or folder")
    try:
        backend = RustTokenizer.from_file(path)
    except Exception as err:  # tokenizers raises its own Exception subclass for bad JSON
        raise InputError(f"{path}: not a Hugging Face tokenizer.json ({one_line(err)})") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise InputError(f"{path}: not readable JSON ({one_line(err)})") from None


class GPT2BPETokenizer(_RustTokenizer):
    """GPT-2's byte-level BPE from --vocab-file (vocab.json) and --merge-file (merges.txt):
    no prefix space, no special tokens added, <|endoftext|> ends a document."""

    add_special_tokens = False

    def __init__(self, vocab_file: str | None, merge_file: str | None):
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab_file = existing_file(vocab_file, "--vocab-file", "GPT-2 vocab.json")
        merge_file = existing_file(merge_file, "--merge-file", "GPT-2 merges.txt")
        self.source = f"the tokenizer {vocab_file}"
        vocab = _read_json(vocab_file)
        if not isinstance(vocab, dict) or GPT2_EOD not in vocab:
            raise InputError(
                f"--vocab-file {vocab_file}: not a GPT-2 vocab.json with {GPT2_EOD} (a JSON "
                "object of token -> id)"
            )
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as err:  # tokenizers' own exception type
            raise InputError(
                f"--merge-file {merge_file}: not GPT-2 merges for {vocab_file} ({one_line(err)})"
            ) from None
        backend = RustTokenizer(model)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        self._hf = PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token=GPT2_EOD, eos_token=GPT2_EOD, unk_token=GPT2_EOD
        )
        self._set_specials(None)
