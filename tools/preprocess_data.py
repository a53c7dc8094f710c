"""Tokenize raw text into Megatron-LM indexed datasets: <prefix>_<key>_document.bin / .idx.

Inputs: .jsonl (.gz, .zst), .parquet, or folders of .txt; a file, a glob or a folder. With
--executor ray or slurm, a task per input file on a Ray cluster or Slurm job arrays, then one
merging them in input order: the same files as one machine writes.
"""

from __future__ import annotations

import sys

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.data.prepare.preprocess import preprocess
from engine.data.tokenizers.cli import add_tokenizer_arguments, tokenizer_config
from engine.data.tokenizers.gigatoken_encoder import CHOICES
from engine.errors import ConfigError
from engine.execution.choice import add_executor_arguments, executor_from_arguments


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True, help="file, glob or folder")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize")
    group.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="skip and count malformed records instead of stopping at the first",
    )
    group.add_argument(
        "--split-sentences",
        action="store_true",
        help="not supported: documents are kept whole (NLTK sentence splitting is for BERT)",
    )
    group.add_argument(
        "--keep-newlines",
        action="store_true",
        help="accepted; newlines are always kept, since documents are never split",
    )
    group.add_argument("--lang", default="english", help="accepted; only --split-sentences uses it")
    add_tokenizer_arguments(parser)
    group = parser.add_argument_group("tokenization process")
    group.add_argument(
        "--append-eod", action="store_true", help="end each document with the eod token"
    )
    group.add_argument(
        "--tokenize-with",
        choices=CHOICES,
        default="tokenizer",
        help="tokenizer (default): the tokenizer's own library, exact; auto: gigatoken where it "
        "is installed and encodes probe texts to the tokenizer's ids (several times faster, "
        "approximate: a rare document can come out different), else the library; gigatoken: "
        "insist on it",
    )
    group.add_argument(
        "--use-gigatoken",
        dest="tokenize_with",
        action="store_const",
        const="gigatoken",
        help="Megatron-LM's preprocess_data_fast.py flag: --tokenize-with gigatoken",
    )
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True)
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    group.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="accepted: the output is the same for any number; all --workers share one input",
    )
    group.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="accepted; documents always keep their input order",
    )
    group.add_argument("--log-interval", type=int, default=10000, help="documents between logs")
    group.add_argument("--no-progress", action="store_true", help="no progress bar or log lines")
    add_executor_arguments(parser)
    args = parser.parse_args(argv)
    if args.split_sentences:
        raise ConfigError(
            "--split-sentences is not supported: GPT pretraining keeps documents whole; drop it"
        )
    if args.partitions < 1:
        raise ConfigError(f"--partitions {args.partitions}: need at least 1")
    if args.executor != "local":
        stats = _distributed(args)
    else:
        stats = _local(args)
    for message in stats.skip_messages:
        print(f"skipped: {message}", file=sys.stderr)
    print(stats.summary())
    for prefix in stats.outputs:
        print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


def _local(args):
    executor_from_arguments(args)  # the flags' checks
    return preprocess(
        args.input,
        args.output_prefix,
        tokenizer_config(args),
        json_keys=args.json_keys,
        append_eod=args.append_eod,
        workers=args.workers,
        skip_bad_records=args.skip_bad_records,
        log_interval=args.log_interval,
        progress=not args.no_progress,
        tokenize_with=args.tokenize_with,
    )


def _distributed(args):
    """A task per input file on the cluster, then their merge (engine/data/prepare/
    distributed.py)."""
    from engine.data.prepare import distributed
    from engine.data.prepare.readers import expand_inputs
    from engine.data.tokenizers import build_tokenizer

    executor = executor_from_arguments(args)
    cfg = tokenizer_config(args)
    build_tokenizer(cfg)  # a tokenizer that cannot load is refused here, not in every task
    run = distributed.PreprocessRun(
        args.output_prefix, tuple(expand_inputs(args.input)), cfg, tuple(args.json_keys),
        args.append_eod, args.skip_bad_records, args.tokenize_with,
    )  # fmt: skip
    distributed.start(run)
    executor.run(distributed.preprocess_job(run), distributed.stages(run))
    return distributed.finish(run)


if __name__ == "__main__":
    run(main)
