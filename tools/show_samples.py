"""Print the first packed training samples of a dataset, decoded back to text."""

from __future__ import annotations

import argparse

from engine.cli import run_main as run
from engine.data.builder import build_gpt_datasets
from engine.data.tokenizers import build_tokenizer
from engine.data.tokenizers.cli import add_tokenizer_arguments, tokenizer_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--data-path", nargs="+", required=True, help="prefix or weight/prefix pairs"
    )
    add_tokenizer_arguments(parser)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--split", default="969,30,1")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-samples", type=int, default=2, help="samples to print")
    parser.add_argument("--max-chars", type=int, default=400, help="characters shown per sample")
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer(tokenizer_config(args))
    train, _, _ = build_gpt_datasets(
        args.data_path, args.split, args.seq_length, args.seed, (args.num_samples, 0, 0)
    )
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


if __name__ == "__main__":
    run(main)
