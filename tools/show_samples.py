"""Print the first packed training samples of a dataset, decoded back to text: preprocessed
.bin/.idx prefixes, or Parquet files and folders packed as training streams them."""

from __future__ import annotations

import argparse

from engine.cli import run_main as run
from engine.data.builder import build_gpt_datasets, build_streaming_datasets
from engine.data.sources import data_sources
from engine.data.tokenizers import build_tokenizer
from engine.data.tokenizers.cli import add_tokenizer_arguments, tokenizer_config
from engine.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--data-path", nargs="+", required=True, help="prefix or weight/prefix pairs"
    )
    parser.add_argument("--data-format", choices=["indexed", "parquet"], help="default: detected")
    parser.add_argument("--parquet-text-column", default="text")
    parser.add_argument("--parquet-shuffle-buffer", type=int, default=4096)
    add_tokenizer_arguments(parser)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--split", default="969,30,1")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-samples", type=int, default=2, help="samples to print")
    parser.add_argument("--max-chars", type=int, default=400, help="characters shown per sample")
    args = parser.parse_args(argv)
    config = tokenizer_config(args)
    tokenizer = build_tokenizer(config)
    counts = (args.num_samples, 0, 0)
    sources = data_sources(args.data_path, args.split, data_format=args.data_format)
    if sources.format == "parquet":
        stream = build_streaming_datasets(
            sources,
            args.parquet_text_column,
            args.parquet_shuffle_buffer,
            args.seq_length,
            args.seed,
            counts,
            config,
        )[0]
        if stream is None:
            raise ConfigError(f"--split {args.split} gives the train split no rows to show")
        batches = stream.iterator(0, 1, 0, 1)
        train = [_sample(next(batches)) for _ in range(args.num_samples)]
    else:
        train, _, _ = build_gpt_datasets(sources, args.seq_length, args.seed, counts)
    for i in range(args.num_samples):
        ids = train[i]
        text = tokenizer.detokenize(ids)
        eods = int((ids == tokenizer.eod).sum())
        print(
            f"--- sample {i}: {len(ids)} tokens ({eods} end-of-document), first "
            f"{args.max_chars} characters ---"
        )
        print(text[: args.max_chars])
    return 0


def _sample(batch: dict):
    """The seq_length + 1 tokens of a one-sample micro-batch."""
    import numpy as np

    return np.concatenate([batch["tokens"][0].numpy(), batch["labels"][0, -1:].numpy()])


if __name__ == "__main__":
    run(main)
