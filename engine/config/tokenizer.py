"""The tokenizer flags, with Megatron-LM's names and meanings, shared by training and the tools.

--vocab-size is not one of these flags (training has it in the model group, each tool that
needs it its own); its value is copied into `vocab_size` for the families that read it
(NullTokenizer, TikTokenizer), so that the config alone rebuilds the tokenizer.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from engine.config.fields import option

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "TikTokenizer",
    "NullTokenizer",
)


@dataclass(frozen=True)
class TokenizerConfig:
    """Which tokenizer turns text into ids, and the files it is read from."""

    tokenizer_type: str | None = option(
        None,
        "tokenizer family (default: GPT2BPETokenizer when --vocab-file or --merge-file is given, "
        "as Megatron-LM's pretrain_gpt.py; otherwise SentencePieceTokenizer)",
        choices=list(TOKENIZER_TYPES),
    )
    tokenizer_model: str | None = option(
        None,
        "SentencePiece .model file, Hugging Face folder or tokenizer.json, or TikToken ranks "
        "(.json)",
    )
    vocab_file: str | None = option(None, "GPT-2 BPE vocab.json (GPT2BPETokenizer)")
    merge_file: str | None = option(None, "GPT-2 BPE merges.txt (GPT2BPETokenizer)")
    tiktoken_pattern: str | None = option(
        None, "TikTokenizer's pre-tokenizer regex (default v2)", choices=["v1", "v2"]
    )
    tiktoken_num_special_tokens: int = option(
        1000, "TikTokenizer: ids below this are special tokens; BPE ranks start here"
    )
    null_tokenizer_eod_id: int | None = option(
        None, "NullTokenizer's end-of-document id (default: vocab size - 1)"
    )
    tokenizer_hf_no_include_special_tokens: bool = option(
        False,
        "HuggingFaceTokenizer: encode without the tokenizer's own special tokens (a Llama-3 "
        "style <|begin_of_text|>); by default they are added, as tokenizer(text) adds them",
        switches={"--tokenizer-hf-include-special-tokens": False},
    )
    tokenizer_eod_token: str | None = option(
        None,
        "the token that ends each document (default: the tokenizer's eos); needed by a "
        "Hugging Face tokenizer without one",
    )
    legacy_tokenizer: bool = option(
        False,
        "Megatron-LM's older tokenizer conventions; changes NullTokenizer only (vocab size + "
        "1 ids, end of document = vocab size)",
    )
    trust_remote_code: bool = option(False, "refused: no code from a tokenizer folder is ever run")
    vocab_size: int | None = None  # --vocab-size, for the families that read it (no flag here)

    def __post_init__(self):
        if self.tokenizer_type is None:
            bpe_files = self.vocab_file or self.merge_file
            family = "GPT2BPETokenizer" if bpe_files else "SentencePieceTokenizer"
            object.__setattr__(self, "tokenizer_type", family)

    def with_vocab_size(self, vocab_size: int | None) -> TokenizerConfig:
        """This config with --vocab-size filled in where the family reads it and it is unset."""
        if self.tokenizer_type in READS_VOCAB_SIZE and self.vocab_size is None:
            return dataclasses.replace(self, vocab_size=vocab_size)
        return self


PATH_FIELDS = ("tokenizer_model", "vocab_file", "merge_file")
READS_VOCAB_SIZE = ("NullTokenizer", "TikTokenizer")


def tokenizer_record(cfg: TokenizerConfig) -> dict:
    """What a checkpoint keeps of the tokenizer, so that an export or a continued run builds
    the same one: every field, paths made absolute."""
    record = dataclasses.asdict(cfg)
    for name in PATH_FIELDS:
        if record[name]:
            record[name] = os.path.abspath(record[name])
    return record


def config_from_record(meta: dict) -> TokenizerConfig | None:
    """The tokenizer config a checkpoint's meta records; None when it names no tokenizer.
    Checkpoints from before the record kept only a SentencePiece model path."""
    record = meta.get("tokenizer")
    if isinstance(record, dict):
        names = {f.name for f in dataclasses.fields(TokenizerConfig)}
        return TokenizerConfig(**{k: v for k, v in record.items() if k in names})
    if meta.get("tokenizer_model"):
        return TokenizerConfig(tokenizer_model=meta["tokenizer_model"])
    return None
