"""Shared set-up of the benchmark scripts in tools/: a GPT config from their size flags, and
a dataset and tokenizer from the built-in corpus for those that need real data."""

from __future__ import annotations

import os

from engine.config import ModelConfig
from engine.data.corpus import write_corpus
from engine.data.preprocess import preprocess
from engine.data.tokenizer_training import train_tokenizer


def corpus_dataset(folder: str, vocab_size: int = 8000) -> tuple[str, str]:
    """(dataset prefix, tokenizer model) built under folder (reused when already there)."""
    prefix, model = os.path.join(folder, "data_text_document"), os.path.join(folder, "tok.model")
    if not (os.path.exists(prefix + ".idx") and os.path.exists(model)):
        corpus = write_corpus(os.path.join(folder, "corpus"))["jsonl"]
        train_tokenizer([corpus], model[: -len(".model")], vocab_size=vocab_size)
        preprocess(corpus, os.path.join(folder, "data"), model, append_eod=True, progress=False)
    return prefix, model


def engine_flags(
    prefix: str,
    tokenizer: str,
    num_layers: int,
    hidden_size: int,
    seq_length: int,
    micro_batch_size: int,
    **extra: str,
) -> list[str]:
    """engine.pretrain flags for a benchmark model on the corpus dataset; extra adds flags
    (underscores become dashes: global_batch_size="8" -> --global-batch-size 8)."""
    values = {
        "data_path": prefix,
        "tokenizer_model": tokenizer,
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_attention_heads": max(1, hidden_size // 64),
        "seq_length": seq_length,
        "micro_batch_size": micro_batch_size,
        **extra,
    }
    flags: list[str] = []
    for name, value in values.items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def bench_model_config(args, **extra) -> ModelConfig:
    """GPT-2 style, 64-wide heads, no dropout, shaped by --num-layers, --hidden-size,
    --seq-length and --vocab-size."""
    return ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.hidden_size // 64,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **extra,
    )
