"""Training straight from Parquet: the tokens/s the streaming loader delivers per core, against
the tokens/s training consumes.

Input: the built-in corpus scaled to --target-mb (Caesar-shifted copies, as in
bench_preprocess.py), written as --shards Parquet shards with row groups of 1,000 rows.

Loader rows: for a SentencePiece and a Hugging Face byte-level BPE tokenizer, the engine's
streaming dataset (engine/data/streaming/dataset.py, as training builds it) read with 1 and 2
DataLoader workers in micro-batches of 8 samples of --seq-length + 1 tokens, until every row was
read once. The rate leaves out the first micro-batch (the workers' start-up); tokens are new tokens
(seq-length per sample). Per core = the rate / the workers (the main process only collates).

Consumers, a 125M (12 layers, hidden 768, 12 heads) and a 1.3B (24 layers, hidden 2048, 16
heads) GPT at --seq-length with the GPT-2 vocabulary:
  - one training step on this machine's CPU, measured (fp32, micro-batch 1, all cores, the
    engine's own step on random tokens). The 1.3B runs with full activation recompute and SGD
    without momentum: Adam's state beside its weights and gradients would not fit in 24 GB,
    and the update is a small part of a step that spends its time in forward and backward;
  - one H100 at 45% MFU, by the FLOP count (engine/monitor/metrics.py): 0.45 x 989 TFLOP/s divided
    by the training FLOPs per token. Nothing runs on a GPU here.
The table gives each consumer's tokens/s and the loader cores it needs: its tokens/s over the
slower tokenizer's tokens/s per core. Prints the tables and writes JSON.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.config.tokenizer import TokenizerConfig
from engine.data.builder import build_streaming_datasets
from engine.data.sources import data_sources
from engine.monitor.metrics import PEAK_TFLOPS, model_flops_per_token
from engine.planning.bench_setup import bench_tokenizers, shifted_documents, time_train_steps
from parallel.local_ranks import run_local

MODELS = {"125M": (12, 768, 12), "1.3B": (24, 2048, 16)}
H100_MFU = 0.45
GPT2_VOCAB = 50257


def write_shards(folder: str, target_bytes: int, shards: int) -> int:
    """Parquet shards of the shifted corpus under folder; returns the text bytes written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = list(shifted_documents(target_bytes))
    per_shard = -(-len(texts) // shards)
    os.makedirs(folder, exist_ok=True)
    for i in range(shards):
        part = texts[i * per_shard : (i + 1) * per_shard]
        table = pa.table({"text": pa.array(part, type=pa.string())})
        pq.write_table(table, os.path.join(folder, f"shard-{i:03d}.parquet"), row_group_size=1000)
    return sum(len(t.encode("utf-8")) for t in texts)


def loader_rate(folder: str, tokenizer: TokenizerConfig, workers: int, args) -> dict:
    """Tokens/s the streaming dataset delivers over one pass of the shards."""
    train, _, _ = build_streaming_datasets(
        data_sources([folder], "100,0,0"),
        "text",
        args.shuffle_buffer,
        args.seq_length,
        1234,
        (10**12, 0, 0),
        tokenizer,
    )
    micro_batch = 8
    batches = train.iterator(0, micro_batch, 0, 1, num_workers=workers)
    stream = batches.streams[0]
    windows = stream.plan.windows_per_epoch
    next(batches)
    start, samples = time.perf_counter(), 0
    while stream.window < windows:
        next(batches)
        samples += micro_batch
    seconds = time.perf_counter() - start
    tokens_per_s = samples * args.seq_length / seconds
    return {
        "workers": workers,
        "seconds": seconds,
        "samples": samples,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_core": tokens_per_s / workers,
    }


def _model_flags(name: str, seq_length: int) -> list[str]:
    layers, hidden, heads = MODELS[name]
    flags = [
        *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(GPT2_VOCAB)),
        *("--num-layers", str(layers), "--hidden-size", str(hidden)),
        *("--num-attention-heads", str(heads), "--seq-length", str(seq_length)),
        *("--max-position-embeddings", str(seq_length)),
        *("--micro-batch-size", "1", "--train-iters", "1000", "--lr", "1e-4"),
        *("--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--device", "cpu"),
    ]
    if name == "1.3B":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        flags += ["--recompute-num-layers", "1", "--optimizer", "sgd", "--sgd-momentum", "0"]
    return flags


def _cpu_step(rank, world, name: str, seq_length: int, warmup: int, steps: int) -> dict:
    return time_train_steps(_model_flags(name, seq_length), warmup, steps, "cpu")


def h100_tokens_per_s(name: str, seq_length: int) -> tuple[float, float]:
    """(tokens/s at 45% of the H100's dense bf16 peak, training FLOPs per token)."""
    from engine.pretrain import parse
    from engine.train.preflight import prepare

    cfg = prepare(parse(_model_flags(name, seq_length)), 1)
    flops = model_flops_per_token(cfg.model, cfg.model.padded_vocab_size(1))
    return H100_MFU * PEAK_TFLOPS[("H100 SXM", "bf16")] * 1e12 / flops, flops


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--target-mb", type=float, default=60.0, help="text in the shards")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--shuffle-buffer", type=int, default=4096, help="rows per window")
    parser.add_argument("--vocab-size", type=int, default=32000, help="of the trained tokenizers")
    parser.add_argument("--sentencepiece-model", help="use this model instead of training one")
    parser.add_argument("--hf-tokenizer", help="use this folder instead of training one")
    parser.add_argument(
        "--cpu-models",
        nargs="*",
        default=list(MODELS),
        choices=list(MODELS),
        help="models whose CPU step is measured (the 1.3B takes minutes)",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", default="bench_streaming.json", help="where to write results")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "shards")
        nbytes = write_shards(folder, int(args.target_mb * 1e6), args.shards)
        models = bench_tokenizers(tmp, args.vocab_size, args.sentencepiece_model, args.hf_tokenizer)
        configs = {
            "sentencepiece": TokenizerConfig(tokenizer_model=models["sentencepiece"]),
            "hf-bpe": TokenizerConfig(
                tokenizer_type="HuggingFaceTokenizer", tokenizer_model=models["hf-bpe"]
            ),
        }
        loaders = [
            {"tokenizer": kind, **loader_rate(folder, config, workers, args)}
            for kind, config in configs.items()
            for workers in (1, 2)
        ]
    consumers = []
    for name in MODELS:
        if name in args.cpu_models:
            step = run_local(
                _cpu_step,
                1,
                name,
                args.seq_length,
                args.warmup,
                args.steps,
                timeout=7200,
                threads=os.cpu_count() or 1,
            )[0]
            consumers.append(
                {
                    "consumer": f"{name} training step, this CPU (fp32)",
                    "tokens_per_s": args.seq_length / step["step_s"],
                    "step_s": step["step_s"],
                    "params": step["params"],
                }
            )
        rate, flops = h100_tokens_per_s(name, args.seq_length)
        consumers.append(
            {
                "consumer": f"{name} on one H100 at 45% MFU (by FLOPs)",
                "tokens_per_s": rate,
                "flops_per_token": flops,
            }
        )
    per_core = min(r["tokens_per_s_per_core"] for r in loaders)
    for c in consumers:
        c["loader_cores"] = c["tokens_per_s"] / per_core
    _print(nbytes, args, loaders, consumers)
    with open(args.json, "w") as f:
        json.dump(
            {
                "text_mb": nbytes / 1e6,
                "cpu_cores": os.cpu_count(),
                "config": vars(args),
                "loaders": loaders,
                "consumers": consumers,
            },
            f,
            indent=1,
        )
    return 0


def _print(nbytes: int, args, loaders: list[dict], consumers: list[dict]) -> None:
    print(
        f"input: {nbytes / 1e6:.0f} MB of text in {args.shards} Parquet shards; seq-length "
        f"{args.seq_length}; windows of {args.shuffle_buffer} rows; {os.cpu_count()} CPU cores"
    )
    print(f"{'tokenizer':14s} {'workers':>7s} {'seconds':>8s} {'tokens/s':>12s} {'per core':>12s}")
    for r in loaders:
        print(
            f"{r['tokenizer']:14s} {r['workers']:7d} {r['seconds']:8.1f} "
            f"{r['tokens_per_s']:12,.0f} {r['tokens_per_s_per_core']:12,.0f}"
        )
    print(f"\n{'consumer':44s} {'tokens/s':>12s} {'loader cores':>13s}")
    for c in consumers:
        print(f"{c['consumer']:44s} {c['tokens_per_s']:12,.1f} {c['loader_cores']:13.3g}")
    print(
        "loader cores: the consumer's tokens/s over the slower tokenizer's loader tokens/s per core"
    )


if __name__ == "__main__":
    run(main)
