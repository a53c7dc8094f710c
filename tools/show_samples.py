"""Print the first packed training samples of a dataset, decoded back to text: preprocessed
.bin/.idx prefixes, or Parquet files and folders packed as training streams them. Under each
sample: the tokens where its documents start (where --reset-position-ids restarts positions
and --reset-attention-mask cuts attention) and the predictions that carry no loss
(--eod-mask-loss); with --by-document each document is printed on its own, marked."""

from __future__ import annotations

import torch

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.data.builder import build_gpt_datasets, build_streaming_datasets
from engine.data.documents import document_layout
from engine.data.sources import data_sources
from engine.data.tokenizers import build_tokenizer
from engine.data.tokenizers.cli import add_tokenizer_arguments, tokenizer_config
from engine.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
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
    parser.add_argument("--reset-position-ids", action="store_true", help="as in training")
    parser.add_argument("--reset-attention-mask", action="store_true", help="as in training")
    parser.add_argument("--eod-mask-loss", action="store_true", help="as in training")
    parser.add_argument(
        "--by-document", action="store_true", help="print each document apart, marked"
    )
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
        eods = int((ids == tokenizer.eod).sum())
        print(
            f"--- sample {i}: {len(ids)} tokens ({eods} end-of-document), first "
            f"{args.max_chars} characters ---"
        )
        starts = document_starts(ids, tokenizer.eod)
        if args.by_document:
            ends = [*starts[1:], len(ids)]
            for k, (start, end) in enumerate(zip(starts, ends, strict=True)):
                print(f"[document {k}: tokens {start}-{end - 1}]")
                print(tokenizer.detokenize(ids[start:end])[: args.max_chars])
        else:
            print(tokenizer.detokenize(ids)[: args.max_chars])
        for line in marks(ids, tokenizer.eod, starts, args):
            print(line)
    return 0


def document_starts(ids, eod: int) -> list[int]:
    """The tokens where the sample's documents start (0, and one past each EOD but the
    last token)."""
    documents = document_layout(torch.as_tensor(ids), eod, reset_attention_mask=True).document_ids
    changes = (documents[1:] != documents[:-1]).nonzero()[:, 0] + 1
    return [0, *changes.tolist()]


def marks(ids, eod: int, starts: list[int], args) -> list[str]:
    """The lines saying what the run's flags make of the sample's documents."""

    found = f"documents start at tokens {', '.join(map(str, starts))}"
    flags = [f for f, on in (("positions restart", args.reset_position_ids),
                             ("attention stops", args.reset_attention_mask)) if on]  # fmt: skip
    lines = [found + (f" ({' and '.join(flags)} there)" if flags else "")]
    inputs = torch.as_tensor(ids[:-1])
    layout = document_layout(inputs, eod, eod_mask_loss=args.eod_mask_loss)
    unweighted = (layout.loss_mask == 0).nonzero()[:, 0].tolist()
    if unweighted:
        lines.append(
            f"no loss on the predictions made at tokens {', '.join(map(str, unweighted))} "
            "(--eod-mask-loss)"
        )
    else:
        lines.append(f"loss on all {len(inputs)} predictions")
    return lines


def _sample(batch: dict):
    """The seq_length + 1 tokens of a one-sample micro-batch."""
    import numpy as np

    return np.concatenate([batch["tokens"][0].numpy(), batch["labels"][0, -1:].numpy()])


if __name__ == "__main__":
    run(main)
