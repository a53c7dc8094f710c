"""TikTokenizer: a byte-level BPE given as ranks (Megatron-LM's JSON list of {"rank",
"token_bytes" (base64), "token_str"}), run by `tiktoken`.

As in Megatron-LM, ids below --tiktoken-num-special-tokens are special tokens (<unk>, <s>, </s>,
<mask>, <pad>, <cls>, <sep>, then fillers) and rank r has id r + that number; the vocabulary
is --vocab-size ids (default 131072, or fewer when the ranks file has fewer ranks).
"""

from __future__ import annotations

import base64
import json
import os

from engine.data.tokenizers.base import Tokenizer, existing_file
from engine.errors import ConfigError, InputError
from parallel.errors import one_line

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
DEFAULT_VOCAB_SIZE = 2**17


def read_ranks(path: str, limit: int | None) -> list[bytes]:
    """The token bytes of each rank, in rank order (at most `limit` of them)."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError) as err:
        raise InputError(f"--tokenizer-model {path}: not readable JSON ({one_line(err)})") from None
    if not isinstance(entries, list):
        raise InputError(
            f"--tokenizer-model {path}: a TikToken ranks file is a JSON list of "
            '{"rank", "token_bytes", "token_str"} objects'
        )
    tokens: list[bytes] = []
    for i, entry in enumerate(entries[:limit]):
        try:
            if entry["rank"] != i:
                raise ValueError(f"rank {entry['rank']} where {i} belongs")
            token = base64.b64decode(entry["token_bytes"], validate=True)
            if i < 256 and token != bytes([i]):
                raise ValueError("the first 256 ranks must be the single bytes in order")
        except (KeyError, TypeError, ValueError) as err:
            raise InputError(
                f"--tokenizer-model {path}: entry {i} is malformed ({one_line(err)})"
            ) from None
        tokens.append(token)
    if len(tokens) < 256:
        raise InputError(
            f"--tokenizer-model {path}: {len(tokens)} ranks; a TikToken vocabulary starts with "
            "the 256 single bytes"
        )
    if len(set(tokens)) != len(tokens):
        raise InputError(f"--tokenizer-model {path}: a token appears twice")
    return tokens


class TikTokenizer(Tokenizer):
    def __init__(
        self,
        path: str | None,
        pattern: str | None = None,
        num_special_tokens: int = 1000,
        vocab_size: int | None = None,
    ):
        import tiktoken

        self.path = existing_file(path, "--tokenizer-model", "TikToken ranks file (.json)")
        self.source = f"the tokenizer {self.path}"
        self.pattern = PATTERNS[pattern or "v2"]
        if num_special_tokens < len(SPECIAL_TOKENS):
            raise ConfigError(
                f"--tiktoken-num-special-tokens {num_special_tokens}: at least "
                f"{len(SPECIAL_TOKENS)} ({', '.join(SPECIAL_TOKENS)})"
            )
        limit = (vocab_size or DEFAULT_VOCAB_SIZE) - num_special_tokens
        if limit < 256:
            raise ConfigError(
                f"--vocab-size {vocab_size} leaves fewer than 256 BPE ranks after "
                f"{num_special_tokens} special tokens; raise it"
            )
        self.ranks = read_ranks(self.path, limit)
        if vocab_size is not None and len(self.ranks) < limit:
            raise ConfigError(
                f"--vocab-size {vocab_size} needs {limit} ranks after {num_special_tokens} "
                f"special tokens, but {self.path} has {len(self.ranks)}; use --vocab-size "
                f"{len(self.ranks) + num_special_tokens} or leave it out"
            )
        self.num_special_tokens = num_special_tokens
        self.special_tokens = SPECIAL_TOKENS + [
            f"<SPECIAL_{i}>" for i in range(len(SPECIAL_TOKENS), num_special_tokens)
        ]
        self.vocab_size = num_special_tokens + len(self.ranks)
        self.unk, self.bos, self.eos, self.pad = 0, 1, 2, 4
        self.eod = self.eos
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(self.path),
            pat_str=self.pattern,
            mergeable_ranks={t: r + num_special_tokens for r, t in enumerate(self.ranks)},
            special_tokens={t: i for i, t in enumerate(self.special_tokens)},
        )

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Special-token text (<s>, ...) is read as the special token, as in Megatron-LM."""
        return self._encoding.encode_batch(texts, num_threads=1, allowed_special="all")

    def detokenize(self, ids) -> str:
        return self._encoding.decode([int(i) for i in ids])

    def token_id(self, text: str) -> int | None:
        if text in self.special_tokens:
            return self.special_tokens.index(text)
        ids = self._encoding.encode(text, allowed_special="all")
        return ids[0] if len(ids) == 1 else None

    def save_hf(self, folder: str) -> None:
        from engine.data.tokenizers.tiktoken_to_hf import save_as_hf

        save_as_hf(self, folder)
