"""Train a fastText classifier for tools/curate.py's quality_classifier stage (or, trained on
toxic and non-toxic documents, its toxicity_classifier stage), as DCLM trained its filter:
positives are reference text (DCLM: instruction data and ELI5 answers; FineWeb-Edu: pages an
annotator rated educational), negatives the crawl to be filtered.

    python tools/train_quality_classifier.py --positive reference/ --negative crawl/ \
        --output quality.bin

Inputs are read as tools/curate.py reads them (JSONL, Parquet, .txt; files, folders or
globs). The model is written to --output; a share of each class is held out and scored
(accuracy and precision at 0.5, recall, AUC). Then, in the curation config:

    quality_classifier: {model: quality.bin, threshold: 0.5}
"""

from __future__ import annotations

import argparse

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.curation.models.train_classifier import TrainingSettings, read_texts, train_classifier
from engine.data.prepare.readers import SUPPORTED, expand_inputs
from engine.errors import ConfigError


def _parser() -> ArgumentParser:
    d = TrainingSettings()
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--positive", nargs="+", required=True, help="files, folders or globs")
    p.add_argument("--negative", nargs="+", required=True, help="files, folders or globs")
    p.add_argument("--output", required=True, help="the model file to write (.bin)")
    p.add_argument("--text-key", default="text", help="the field holding the document's text")
    p.add_argument("--positive-label", default=d.positive_label)
    p.add_argument("--negative-label", default=d.negative_label)
    p.add_argument("--epoch", type=int, default=d.epoch)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--dim", type=int, default=d.dim, help="word vector size")
    p.add_argument("--word-ngrams", type=int, default=d.word_ngrams, help="2: word bigrams")
    p.add_argument("--min-count", type=int, default=d.min_count)
    p.add_argument("--threads", type=int, default=d.threads, help="1: the result is the seed's")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-balance", action="store_true", help="keep every document of both")
    p.add_argument("--validation", type=float, default=d.validation, help="share held out")
    p.add_argument("--max-documents", type=int, default=0, help="per class; 0: all")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for flag, value, low in (
        ("--epoch", args.epoch, 1), ("--dim", args.dim, 1), ("--word-ngrams", args.word_ngrams, 1),
        ("--min-count", args.min_count, 1), ("--threads", args.threads, 1),
        ("--max-documents", args.max_documents, 0),
    ):  # fmt: skip
        if value < low:
            raise ConfigError(f"{flag} {value}: give at least {low}")
    if not 0.0 <= args.validation < 1.0:
        raise ConfigError(f"--validation {args.validation}: give a share in [0, 1)")
    if args.lr <= 0:
        raise ConfigError(f"--lr {args.lr}: give a positive learning rate")
    if args.positive_label == args.negative_label or not all(
        label and " " not in label for label in (args.positive_label, args.negative_label)
    ):
        raise ConfigError("--positive-label / --negative-label: give two different single words")
    settings = TrainingSettings(
        positive_label=args.positive_label, negative_label=args.negative_label,
        epoch=args.epoch, lr=args.lr, dim=args.dim, word_ngrams=args.word_ngrams,
        min_count=args.min_count, threads=args.threads, seed=args.seed,
        balance=not args.no_balance, validation=args.validation,
        max_documents=args.max_documents,
    )  # fmt: skip
    positive_files = expand_inputs(args.positive, SUPPORTED)
    negative_files = expand_inputs(args.negative, SUPPORTED)
    positive = read_texts(positive_files, args.text_key, args.max_documents)
    negative = read_texts(negative_files, args.text_key, args.max_documents)
    counts, evaluation = train_classifier(positive, negative, args.output, settings)
    print(f"{'class':<10}{'read':>10}{'train':>10}{'held out':>10}")
    for name, c in counts.items():
        print(f"{name:<10}{c['read']:>10,}{c['train']:>10,}{c['held_out']:>10,}")
    if evaluation is not None:
        e = evaluation
        print(
            f"held out ({e.documents:,} documents): accuracy {e.accuracy:.4f}, precision "
            f"{e.precision:.4f}, recall {e.recall:.4f} at 0.5; AUC {e.auc:.4f}"
        )
    print(f"model: {args.output} (label {settings.positive_label!r} is the score)")
    return 0


if __name__ == "__main__":
    run_main(main)
