"""Real tokenizer files of every family, made from the built-in corpus (no downloads): a byte-level
BPE trained by tools/train_tokenizer.py --library hf, and from it the other formats the families
read (GPT-2 vocab/merges, a Llama-3 style folder that adds <|begin_of_text|>, TikToken ranks)."""

from __future__ import annotations

import base64
import json
import os
import shutil

from engine.data.tokenizers.train_hf import train_hf_tokenizer


def byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def make_hf_folder(corpus_jsonl: str, folder: str, vocab_size: int = 1500) -> str:
    train_hf_tokenizer([corpus_jsonl], folder, vocab_size=vocab_size)
    return folder


def make_bos_folder(hf_folder: str, folder: str) -> str:
    """A Llama-3 style folder: <|begin_of_text|> is added before every text by the
    tokenizer's own post-processor, so tokenizer(text) starts with it."""
    from tokenizers import AddedToken, Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_file(os.path.join(hf_folder, "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<|begin_of_text|>", special=True)])
    bos = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|endoftext|>"
    )
    hf.save_pretrained(folder)
    return folder


def make_tiktoken_ranks(hf_folder: str, path: str) -> str:
    """Megatron-LM's TikToken JSON: the 256 bytes, then each merge's result in merge order."""
    decode = byte_decoder()
    with open(os.path.join(hf_folder, "merges.txt"), encoding="utf-8") as f:
        merges = [line.split() for line in f if line.strip() and not line.startswith("#v")]
    tokens = [bytes([i]) for i in range(256)]
    seen = set(tokens)
    for left, right in merges:
        token = bytes(decode[c] for c in left + right)
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    entries = [
        {
            "rank": rank,
            "token_bytes": base64.b64encode(token).decode(),
            "token_str": token.decode("utf-8", errors="replace"),
        }
        for rank, token in enumerate(tokens)
    ]
    with open(path, "w") as f:
        json.dump(entries, f)
    return path


def copy_gpt2_files(hf_folder: str, folder: str) -> tuple[str, str]:
    os.makedirs(folder, exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(os.path.join(hf_folder, name), os.path.join(folder, name))
    return os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
