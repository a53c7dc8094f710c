"""Every tokenizer family users bring, behind one interface (base.Tokenizer) and one
build_tokenizer: SentencePiece (ours and Llama-2's), Hugging Face, GPT-2 BPE, TikToken, null.
Their flags are engine/config/tokenizer.py's TokenizerConfig."""

from engine.data.tokenizers.base import Tokenizer
from engine.data.tokenizers.build import build_tokenizer

__all__ = ["Tokenizer", "build_tokenizer"]
