"""Train a tokenizer from .jsonl / .parquet / folders of text.

--library sentencepiece (the default): a SentencePiece BPE or unigram model, PREFIX.model and
.vocab, with fixed ids <unk>=0, <s>=1, </s>=2 (end of document), <pad>=3; load it with
--tokenizer-type SentencePieceTokenizer --tokenizer-model PREFIX.model.
--library hf: a byte-level BPE trained with Hugging Face's tokenizers, written as the folder
--output-dir (tokenizer.json, vocab.json, merges.txt); <|endoftext|>=0 ends documents; load it
with --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (or GPT2BPETokenizer with its
--vocab-file and --merge-file).
Both print tokens per word (fertility) and bytes per token on held-out documents.
"""

from __future__ import annotations

import argparse
import sys

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.data.tokenizers.train_sentencepiece import train_tokenizer
from engine.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--input", nargs="+", required=True, help="files, globs or folders")
    parser.add_argument(
        "--library",
        choices=["sentencepiece", "hf"],
        default="sentencepiece",
        help="SentencePiece model, or a Hugging Face byte-level BPE folder",
    )
    parser.add_argument("--model-prefix", help="sentencepiece: writes PREFIX.model and .vocab")
    parser.add_argument("--output-dir", help="hf: the tokenizer folder to write")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--character-coverage", type=float, default=0.9999)
    parser.add_argument(
        "--byte-fallback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="encode characters outside the vocabulary as bytes instead of <unk>",
    )
    parser.add_argument(
        "--input-sentence-size",
        type=int,
        default=1_000_000,
        help="train on a random sample of this many lines (0: all)",
    )
    parser.add_argument(
        "--max-sentence-length",
        type=int,
        default=16384,
        help="lines longer than this many bytes are split into chunks, never dropped",
    )
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="skip and count malformed records instead of stopping at the first",
    )
    parser.add_argument("--user-defined-symbols", nargs="*", default=[])
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    _check_ranges(args)
    if args.library == "hf":
        report = _train_hf(args)
    else:
        report = _train_sentencepiece(args)
    for message in report.skip_messages:
        print(f"skipped: {message}", file=sys.stderr)
    print(report.summary())
    return 0


SENTENCEPIECE_ONLY = {
    "--model-type": "bpe",
    "--character-coverage": 0.9999,
    "--byte-fallback": True,
    "--input-sentence-size": 1_000_000,
    "--user-defined-symbols": [],
    "--seed": 1234,
}


def _check_ranges(args) -> None:
    """The numbers SentencePiece checks itself, refused here in one line naming the flag."""
    if args.max_sentence_length < MIN_SENTENCE_BYTES:
        raise ConfigError(
            f"--max-sentence-length {args.max_sentence_length}: give at least "
            f"{MIN_SENTENCE_BYTES} bytes (the default is 16384)"
        )
    if args.input_sentence_size < 0:
        raise ConfigError(
            f"--input-sentence-size {args.input_sentence_size}: give 0 (every line) or a "
            "positive number of lines"
        )
    if not 0.98 <= args.character_coverage <= 1.0:
        raise ConfigError(
            f"--character-coverage {args.character_coverage}: SentencePiece takes 0.98 to 1.0 "
            "(0.9995 for languages with many characters, 1.0 for small alphabets)"
        )


MIN_SENTENCE_BYTES = 10  # SentencePiece's own minimum for max_sentence_length


def _train_hf(args):
    from engine.data.tokenizers.train_hf import train_hf_tokenizer

    if not args.output_dir:
        raise ConfigError("--library hf writes a folder: give --output-dir DIR")
    if args.model_prefix:
        raise ConfigError("--model-prefix is for --library sentencepiece; use --output-dir DIR")
    for flag, default in SENTENCEPIECE_ONLY.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")) != default:
            raise ConfigError(f"{flag} is for --library sentencepiece; drop it with --library hf")
    return train_hf_tokenizer(
        args.input,
        args.output_dir,
        vocab_size=args.vocab_size,
        json_keys=args.json_keys,
        max_sentence_length=args.max_sentence_length,
        skip_bad_records=args.skip_bad_records,
    )


def _train_sentencepiece(args):
    if not args.model_prefix:
        raise ConfigError("--library sentencepiece writes PREFIX.model: give --model-prefix")
    if args.output_dir:
        raise ConfigError("--output-dir is for --library hf; use --model-prefix PREFIX")
    return train_tokenizer(
        args.input,
        args.model_prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        character_coverage=args.character_coverage,
        byte_fallback=args.byte_fallback,
        input_sentence_size=args.input_sentence_size,
        max_sentence_length=args.max_sentence_length,
        json_keys=args.json_keys,
        user_defined_symbols=args.user_defined_symbols,
        seed=args.seed,
        skip_bad_records=args.skip_bad_records,
    )


if __name__ == "__main__":
    run(main)
