"""Look at what a curation run removed and kept: a seeded sample of documents per removal rule
and of the kept ones, with their fields (URL, language, scores), as one HTML page to open in
a browser (the pretraining guides' advice: read what each rule removes before trusting it).

    python tools/inspect_curation.py --run curated/ [--per-rule 5] [--seed 0] \
        [--output curated/inspect.html]
"""

from __future__ import annotations

import argparse
import os

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.curation.inspect import render, sample_run
from engine.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, help="the --output folder of tools/curate.py")
    parser.add_argument("--per-rule", type=int, default=5, help="documents shown per rule")
    parser.add_argument("--seed", type=int, default=0, help="another seed, another sample")
    parser.add_argument("--max-chars", type=int, default=3000, help="characters shown per text")
    parser.add_argument("--output", help="the HTML page (default: <run>/inspect.html)")
    args = parser.parse_args(argv)
    for flag, value in (("--per-rule", args.per_rule), ("--max-chars", args.max_chars)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: give at least 1")
    if not os.path.isdir(args.run):
        raise ConfigError(f"--run {args.run}: not a folder; give tools/curate.py's --output")
    sample, report, text_key = sample_run(args.run, args.per_rule, args.seed)
    page = render(sample, report, text_key, args.max_chars, args.run)
    output = args.output or os.path.join(args.run, "inspect.html")
    tmp = output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, output)
    shown = sum(len(sample.documents(rule)) for rule in sample.counts)
    print(f"{shown} documents of {len(sample.counts)} rules (kept included): {output}")
    return 0


if __name__ == "__main__":
    run_main(main)
