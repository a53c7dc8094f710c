"""Shared set-up of the benchmark scripts in tools/: a GPT config from their size flags, a
dataset and tokenizer from the built-in corpus for those that need real data, a corpus of any
size whose copies do not repeat, the two tokenizers the data benchmarks compare, and the timing
of real training steps."""

from __future__ import annotations

import os
import statistics
import string
import time
from collections.abc import Iterator

from engine.config.model import ModelConfig
from engine.data.prepare.corpus import stdlib_sources, write_corpus
from engine.data.prepare.preprocess import preprocess
from engine.data.tokenizers.train_sentencepiece import train_tokenizer
from parallel.local_ranks import start_forkserver


def corpus_dataset(folder: str, vocab_size: int = 8000) -> tuple[str, str]:
    """(dataset prefix, tokenizer model) built under folder (reused when already there)."""
    prefix, model = os.path.join(folder, "data_text_document"), os.path.join(folder, "tok.model")
    if not (os.path.exists(prefix + ".idx") and os.path.exists(model)):
        # the benchmark's ranks are forked from the forkserver preprocessing would start first
        start_forkserver()
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
        "max_position_embeddings": seq_length,
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


def _shifted(text: str, r: int) -> str:
    lower, upper = string.ascii_lowercase, string.ascii_uppercase
    table = str.maketrans(lower + upper, lower[r:] + lower[:r] + upper[r:] + upper[:r])
    return text.translate(table)


def shifted_documents(target_bytes: int) -> Iterator[str]:
    """The built-in corpus's documents, copy after copy, until about target_bytes of UTF-8 text.

    Copy 0 is the corpus itself; copy r shifts every ASCII letter by r places (r mod 26), so
    that no copy repeats another's words: gigatoken and `tokenizers` cache the pieces they have
    encoded, and plain repeats would flatter them.
    """
    documents = [text for _, text in stdlib_sources(10**10)]
    size, copy = 0, 0
    while size < target_bytes:
        for text in documents:
            text = _shifted(text, copy % 26) if copy % 26 else text
            yield text
            size += len(text.encode("utf-8"))
            if size >= target_bytes:
                return
        copy += 1


def bench_tokenizers(
    folder: str, vocab_size: int, sentencepiece_model: str | None, hf_tokenizer: str | None
) -> dict[str, str]:
    """{"sentencepiece": .model path, "hf-bpe": Hugging Face folder}: the given ones, or trained
    under folder on 12 MB of the shifted corpus."""
    import json

    from engine.data.tokenizers.train_hf import train_hf_tokenizer
    from engine.data.tokenizers.train_sentencepiece import train_tokenizer

    sample = os.path.join(folder, "tokenizer_sample.jsonl")
    if sentencepiece_model is None or hf_tokenizer is None:
        with open(sample, "w", encoding="utf-8") as f:
            for text in shifted_documents(12_000_000):
                f.write(json.dumps({"text": text}) + "\n")
    if sentencepiece_model is None:
        sentencepiece_model = os.path.join(folder, "sp.model")
        train_tokenizer(
            [sample], sentencepiece_model[: -len(".model")], vocab_size, input_sentence_size=200_000
        )
    if hf_tokenizer is None:
        hf_tokenizer = os.path.join(folder, "hf")
        train_hf_tokenizer([sample], hf_tokenizer, vocab_size)
    return {"sentencepiece": sentencepiece_model, "hf-bpe": hf_tokenizer}


def time_train_steps(flags: list[str], warmup: int, steps: int, device: str) -> dict:
    """Median seconds of `steps` real training iterations (after `warmup`) of the engine set up
    from engine.pretrain flags on one process, with FLOPs per token, parameters and peak CUDA
    memory (GB; None on the CPU). Batches are random tokens of the configured shape."""
    import torch

    from engine.monitor.metrics import model_flops_per_token
    from engine.pretrain import parse
    from engine.train.iteration import train_iteration
    from engine.train.preflight import prepare
    from engine.train.setup import setup
    from parallel.state import ParallelState

    cfg = prepare(parse(flags), 1)
    engine = setup(cfg, ParallelState.build(1, 1, device=device))
    dev = torch.device(device)
    mbs, seq = cfg.training.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (mbs, seq + 1))
    batch = {"tokens": tokens[:, :-1].to(dev), "labels": tokens[:, 1:].to(dev)}
    times = []
    for step in range(warmup + steps):
        sync_device(dev)
        start = time.perf_counter()
        train_iteration(engine, [batch])
        engine.progress.counters.iteration += 1
        sync_device(dev)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return {
        "step_s": statistics.median(times),
        "flops_per_token": model_flops_per_token(cfg.model, cfg.model.padded_vocab_size(1)),
        "params": sum(p.numel() for c in engine.chunks for p in c.params),
        "mem_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None,
    }


def sync_device(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
