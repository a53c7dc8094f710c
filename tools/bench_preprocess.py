"""Benchmark preprocess_data.py against the raw SentencePiece encode ceiling, same text, one run.

Scales the built-in corpus to about --target-mb of JSONL, then measures:
  - start-up: a whole preprocess_data.py run on a one-document input (imports, tokenizer load);
  - preprocess_data.py tokens/s at 1 and 2 workers (whole process wall time);
  - the ceiling: SentencePiece encoding the same texts already in memory, nothing else (no
    reading, decoding or writing): the faster of its own --ceiling-threads threads and
    --ceiling-threads times its one-thread rate (perfect scaling).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from engine.cli import run_main as run
from engine.data.corpus import stdlib_sources
from engine.data.tokenizer_training import train_tokenizer

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preprocess_data.py")


def _write_scaled_corpus(path: str, target_bytes: int) -> list[str]:
    documents = [text for _, text in stdlib_sources()]
    texts, size = [], 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target_bytes:
            for text in documents:
                f.write(json.dumps({"text": text}) + "\n")
                texts.append(text)
                size += len(text.encode("utf-8"))
    return texts


def _preprocess_seconds(inputs: str, prefix: str, model: str, workers: int) -> float:
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            TOOL,
            "--input",
            inputs,
            "--output-prefix",
            prefix,
            "--tokenizer-model",
            model,
            "--append-eod",
            "--workers",
            str(workers),
            "--no-progress",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target-mb", type=float, default=50.0)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--tokenizer-model", help="use this model instead of training one")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--ceiling-threads", type=int, default=2)
    parser.add_argument("--json", default="bench_preprocess.json", help="where to write results")
    args = parser.parse_args(argv)

    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        texts = _write_scaled_corpus(corpus, int(args.target_mb * 1e6))
        nbytes = sum(len(t.encode("utf-8")) for t in texts)
        model = args.tokenizer_model
        if model is None:
            model = os.path.join(tmp, "tok.model")
            train_tokenizer(
                [corpus],
                model[: -len(".model")],
                vocab_size=args.vocab_size,
                input_sentence_size=200_000,
            )
        tiny = os.path.join(tmp, "tiny.jsonl")
        with open(tiny, "w") as f:
            f.write(json.dumps({"text": "def f():\n    return 1\n"}) + "\n")
        startup = min(_preprocess_seconds(tiny, os.path.join(tmp, "t"), model, 1) for _ in range(3))

        sp = spm.SentencePieceProcessor(model_file=model)
        ceiling = {}
        for threads in sorted({1, args.ceiling_threads}):
            start = time.perf_counter()
            encoded = sp.Encode(texts, num_threads=threads)
            ceiling[threads] = time.perf_counter() - start
        tokens = sum(len(ids) for ids in encoded) + len(texts)  # + one eod per document

        rows = []
        for threads, seconds in ceiling.items():
            rows.append((f"SentencePiece encode, {threads} thread(s)", seconds))
        for workers in args.workers:
            seconds = _preprocess_seconds(corpus, os.path.join(tmp, f"w{workers}"), model, workers)
            rows.append((f"preprocess_data.py --workers {workers}", seconds))

    ideal = ceiling[1] / args.ceiling_threads
    rows.insert(len(ceiling), (f"ideal: {args.ceiling_threads} x one-thread encode", ideal))
    best_ceiling = min(ideal, ceiling[args.ceiling_threads])
    print(
        f"corpus: {nbytes / 1e6:.1f} MB, {len(texts):,} documents, {tokens:,} tokens; "
        f"{os.cpu_count()} CPU cores"
    )
    print(f"start-up (one-document run, best of 3): {startup:.2f} s")
    print(f"{'what':42s} {'seconds':>8s} {'tokens/s':>12s} {'MB/s':>7s} {'vs ceiling':>10s}")
    results = []
    for name, seconds in rows:
        rate = tokens / seconds
        share = best_ceiling / seconds
        print(f"{name:42s} {seconds:8.2f} {rate:12,.0f} {nbytes / seconds / 1e6:7.2f} {share:9.0%}")
        results.append(
            {"what": name, "seconds": seconds, "tokens_per_s": rate, "fraction_of_ceiling": share}
        )
    print(f"(ceiling = the faster of the {args.ceiling_threads}-thread and ideal rows)")
    with open(args.json, "w") as f:
        json.dump(
            {
                "corpus_mb": nbytes / 1e6,
                "tokens": tokens,
                "startup_s": startup,
                "cpu_cores": os.cpu_count(),
                "results": results,
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    run(main)
