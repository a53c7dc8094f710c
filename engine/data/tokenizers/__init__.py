"""Every tokenizer family users bring, behind one interface (base.Tokenizer) and one
build_tokenizer: SentencePiece (ours and Llama-2's), Hugging Face, GPT-2 BPE, TikToken, null."""

from engine.data.tokenizers.base import Tokenizer
from engine.data.tokenizers.build import build_tokenizer
from engine.data.tokenizers.config import (
    TOKENIZER_TYPES,
    TokenizerConfig,
    config_from_record,
    tokenizer_record,
)

__all__ = [
    "TOKENIZER_TYPES",
    "Tokenizer",
    "TokenizerConfig",
    "build_tokenizer",
    "config_from_record",
    "tokenizer_record",
]
