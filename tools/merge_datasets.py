"""Merge several indexed datasets (same tokenizer) into one, in the order given."""

from __future__ import annotations

import os

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.data.indexed.dataset import IndexedDataset, IndexedDatasetBuilder, dataset_exists
from engine.errors import InputError


def _prefixes(inputs: list[str]) -> list[str]:
    prefixes: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(
                os.path.join(item, name[: -len(".idx")])
                for name in os.listdir(item)
                if name.endswith(".idx") and dataset_exists(os.path.join(item, name[:-4]))
            )
            if not found:
                raise InputError(f"{item}: folder holds no .bin/.idx pairs")
            prefixes.extend(found)
        else:
            prefixes.append(item[:-4] if item.endswith((".bin", ".idx")) else item)
    return prefixes


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--input", nargs="+", required=True, help="dataset prefixes or a folder")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    args = parser.parse_args(argv)
    prefixes = _prefixes(args.input)
    first = IndexedDataset(prefixes[0])
    dtype = first.dtype
    first.close()
    with IndexedDatasetBuilder(args.output_prefix, dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize()
    merged = IndexedDataset(args.output_prefix)
    print(
        f"merged {len(prefixes)} datasets into {args.output_prefix}: {merged.num_documents:,} "
        f"documents, {merged.num_tokens:,} tokens"
    )
    return 0


if __name__ == "__main__":
    run(main)
