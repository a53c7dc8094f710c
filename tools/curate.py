"""Curate raw text before tokenizing it: web pages' URL rules and main-text extraction,
language ID, heuristic quality rules (Gopher, C4, FineWeb), decontamination, exact and MinHash
deduplication, PII replacement.

    python tools/curate.py --input raw/ --output curated/ [--config curate.yaml] [--workers 2]
    python tools/curate.py ... --executor ray [--ray-address head:6379]
    python tools/curate.py ... --executor slurm [--slurm-partition cpu --slurm-time 4:00:00]

Input: JSONL (plain, .gz, .zst), Parquet or .txt files, as tools/preprocess_data.py reads
them, or a crawl's WARC/WET files (.warc.gz, .warc.wet.gz); a folder or a glob. Output:
curated/kept/*.parquet (the kept documents with every input field), curated/removed/*.parquet
(with `curate_reason`), curated/report.json and report.png. Running the same command again
resumes a killed run. The kept shards go to tools/preprocess_data.py --input curated/kept
unchanged. The stages run as tasks on this machine's processes, a Ray cluster or Slurm job
arrays; the outputs are the same. See docs/curate.md for the config.
"""

from __future__ import annotations

import argparse

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.curation.config import read_config
from engine.curation.pipeline import curate
from engine.curation.web.warc import WARC_SUFFIXES
from engine.data.prepare.preprocess import WORKERS_PER_CPU, available_cpus
from engine.data.prepare.readers import SUPPORTED, expand_inputs
from engine.errors import ConfigError
from engine.execution.choice import add_executor_arguments, executor_from_arguments


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", nargs="+", required=True, help="files, folders or globs")
    parser.add_argument("--output", required=True, help="folder for kept/, removed/ and the report")
    parser.add_argument("--config", help="YAML or JSON: the stages and their parameters")
    parser.add_argument("--workers", type=int, default=1, help="local processes (and the CPUs "
                        "of the local Ray cluster)")  # fmt: skip
    add_executor_arguments(parser)
    parser.add_argument("--dedup-tasks", type=int, default=None,
                        help="tasks each corpus-wide step is cut into (default: one per input "
                        "file, up to 64)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: give at least 1")
    if args.workers > WORKERS_PER_CPU * available_cpus():
        raise ConfigError(
            f"--workers {args.workers}: this process may use {available_cpus()} CPUs; give at "
            f"most {WORKERS_PER_CPU * available_cpus()}"
        )
    if args.dedup_tasks is not None and args.dedup_tasks < 1:
        raise ConfigError(f"--dedup-tasks {args.dedup_tasks}: give at least 1")
    executor = executor_from_arguments(args)
    config = read_config(args.config)
    inputs = expand_inputs(args.input, SUPPORTED + WARC_SUFFIXES)
    report = curate(inputs, args.output, config, args.workers, executor, args.dedup_tasks)
    kept, total = report["kept"]["documents"], report["input"]["documents"]
    print(f"{total:,} documents in, {kept:,} kept, {report['removed_documents']:,} removed")
    if report["skipped_records"]:
        skipped = report["skipped_records"]
        print("  records skipped: " + ", ".join(f"{r} {c:,}" for r, c in skipped.items()))
    for stage, rules in report["removed"].items():
        print(f"  {stage}: " + ", ".join(f"{r.split(':', 1)[1]} {c:,}" for r, c in rules.items()))
    print(f"report: {args.output}/report.json, {args.output}/report.png")
    return 0


if __name__ == "__main__":
    run_main(main)
