"""Benchmark GPTDataset random access: samples/s on one core, and the index build time.

Uses an existing dataset prefix (default: the quickstart's) or builds one from the built-in
corpus with a freshly trained tokenizer. Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.data.indexed.dataset import IndexedDataset
from engine.data.indexed.gpt_dataset import GPTDataset, GPTDatasetSpec
from engine.data.indexed.helpers import build_sample_index, build_sample_index_numpy
from engine.planning.bench_setup import corpus_dataset


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--data-prefix", help="an existing .bin/.idx prefix")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--num-samples", type=int, default=200_000)
    parser.add_argument("--reads", type=int, default=200_000)
    parser.add_argument("--json", default="bench_dataset.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    with tempfile.TemporaryDirectory() as tmp:
        prefix = args.data_prefix or corpus_dataset(tmp)[0]
        indexed = IndexedDataset(prefix)
        sequences = (0, len(indexed.sequence_lengths))
        spec = GPTDatasetSpec(prefix, "train", sequences, args.num_samples, args.seq_length, 1234)
        start = time.perf_counter()
        dataset = GPTDataset(indexed, spec, cache_dir=os.path.join(tmp, "cache"))
        build = time.perf_counter() - start
        start = time.perf_counter()
        GPTDataset(indexed, spec, cache_dir=os.path.join(tmp, "cache"))
        cached = time.perf_counter() - start

        num = len(dataset.sample_index) - 1
        timings = {}
        for name, fn in (("C++", build_sample_index), ("numpy", build_sample_index_numpy)):
            start = time.perf_counter()
            fn(indexed.sequence_lengths, dataset.doc_index, args.seq_length, num)
            timings[name] = time.perf_counter() - start

        order = np.random.default_rng(0).integers(0, len(dataset), args.reads)
        start = time.perf_counter()
        for i in order:
            dataset[i]
        seconds = time.perf_counter() - start

    rate = args.reads / seconds
    print(
        f"dataset: {indexed.num_documents:,} documents, {indexed.num_tokens:,} tokens; "
        f"seq_length {args.seq_length}; {len(dataset):,} samples over {dataset.num_epochs} epochs"
    )
    print(f"{'measure':40s} {'value':>14s}")
    print(f"{'random access, samples/s (one core)':40s} {rate:14,.0f}")
    print(f"{'index build, first start (s)':40s} {build:14.3f}")
    print(f"{'index load from cache, second start (s)':40s} {cached:14.3f}")
    print(f"{'sample index, C++ helper (s)':40s} {timings['C++']:14.4f}")
    print(f"{'sample index, numpy reference (s)':40s} {timings['numpy']:14.4f}")
    with open(args.json, "w") as f:
        json.dump(
            {
                "samples_per_s": rate,
                "seq_length": args.seq_length,
                "build_s": build,
                "cached_s": cached,
                "sample_index_s": timings,
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    run(main)
