"""From the tokenizer flags (TokenizerConfig) to a tokenizer."""

from __future__ import annotations

from engine.config.tokenizer import TOKENIZER_TYPES, TokenizerConfig
from engine.data.tokenizers.base import Tokenizer
from engine.errors import ConfigError


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer the flags name. NullTokenizer and TikTokenizer read cfg.vocab_size
    (--vocab-size, Megatron-LM's meaning); the others take their size from their files."""
    kind = cfg.tokenizer_type
    if cfg.trust_remote_code:
        raise ConfigError(
            "--trust-remote-code: this engine never runs code shipped with a tokenizer; drop "
            "the flag and use a tokenizer folder with a plain tokenizer.json"
        )
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        from engine.data.tokenizers.sentencepiece import SentencePieceTokenizer

        return SentencePieceTokenizer(cfg.tokenizer_model)
    if kind == "Llama2Tokenizer":
        from engine.data.tokenizers.sentencepiece import Llama2Tokenizer

        return Llama2Tokenizer(cfg.tokenizer_model)
    if kind == "HuggingFaceTokenizer":
        from engine.data.tokenizers.huggingface import HuggingFaceTokenizer

        return HuggingFaceTokenizer(
            cfg.tokenizer_model,
            include_special_tokens=not cfg.tokenizer_hf_no_include_special_tokens,
            eod_token=cfg.tokenizer_eod_token,
        )
    if kind == "GPT2BPETokenizer":
        from engine.data.tokenizers.huggingface import GPT2BPETokenizer

        return GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file)
    if kind == "TikTokenizer":
        from engine.data.tokenizers.tiktoken_bpe import TikTokenizer

        return TikTokenizer(
            cfg.tokenizer_model,
            pattern=cfg.tiktoken_pattern,
            num_special_tokens=cfg.tiktoken_num_special_tokens,
            vocab_size=cfg.vocab_size,
        )
    if kind == "NullTokenizer":
        from engine.data.tokenizers.null import NullTokenizer

        return NullTokenizer(cfg.vocab_size, cfg.null_tokenizer_eod_id, cfg.legacy_tokenizer)
    raise ConfigError(f"--tokenizer-type {kind}: choose one of {', '.join(TOKENIZER_TYPES)}")
